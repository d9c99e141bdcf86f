"""Prometheus metrics of the gateway (names are queried by deploy/grafana dashboards).

    gateway_requests_total{tenant,code,model,version}    requests by final status
    gateway_tokens_charged_total{tenant,kind}            kind = prompt | completion
    gateway_tenant_spend_usd_total{tenant,model}         USD by the configured prices
                                                         (gateway.pricing; none unpriced)
    gateway_time_to_first_token_seconds{tenant,model,version}
                                                         request start -> first token sent
    gateway_e2e_latency_seconds{model,version}           request start -> end
    gateway_time_per_output_token_seconds{model,version} first token -> end, per later token
    gateway_overhead_seconds                             time the gateway adds before the
                                                         engine call that produced the
                                                         first token (auth, encode,
                                                         limits, routing, retries)
    gateway_retries_total                                engine attempts retried
    gateway_fair_queue_waiting                           requests waiting for a full model
    gateway_fair_queue_wait_seconds                      how long they waited
    gateway_fair_queue_{timeouts,refused}_total          refused after the wait / at once
    gateway_failovers_total                              mid-stream resumptions
    gateway_breaker_state{replica}                       0 closed, 1 half-open, 2 open
    gateway_ratelimit_denials_total{tenant,dimension}    requests | tokens | concurrency
    gateway_ratelimit_local_denials_total{tenant}        of those, answered from the local
                                                         memo of a request-rate denial
                                                         (no tokenizer call, no Redis)
    gateway_replica_outstanding{replica}                 calls in flight per replica
    gateway_replica_healthy{replica}                     1 when health says SERVING
    gateway_prefix_index_blocks{replica}                 KV blocks the replica's events
                                                         put in the gateway's prefix
                                                         index (0: no events offered)
    gateway_in_flight                                    requests being served
    gateway_tokenizers                                   distinct model tokenizers held

Versions and canaries (``version`` is the engine's ModelInfo.version; "" when
a request ended before it was routed):

    gateway_version_attempts_total{model,version,outcome}   ok | error | neutral | unavailable
    gateway_routing_decisions_total{model,version,reason}   request | pin | weight | any
    gateway_routing_weight_percent{model,version}           live policy weights
    gateway_routing_rollbacks_total{model,trigger}          manual | guard
    gateway_shadow_requests_total{model,version,code}       mirrored calls by outcome
    gateway_shadow_time_to_first_token_seconds{model,version}
    gateway_shadow_skipped_total{model,reason}              saturated | unavailable
"""

from __future__ import annotations

import contextlib
from typing import TypeVar

from prometheus_client import Counter, Gauge, Histogram

from ratelimit.config import Dimension

_LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
)
_OVERHEAD_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)

REQUESTS = Counter(
    "gateway_requests_total",
    "Generate requests by tenant and final gRPC status",
    ["tenant", "code", "model", "version"],
)
TOKENS_CHARGED = Counter(
    "gateway_tokens_charged_total", "Tokens settled against tenants' limits", ["tenant", "kind"]
)
TENANT_SPEND = Counter(
    "gateway_tenant_spend_usd",
    "USD spent by tenant and model, by the configured prices per million prompt and "
    "completion tokens (unpriced models count nothing)",
    ["tenant", "model"],
)
TTFT = Histogram(
    "gateway_time_to_first_token_seconds",
    "Request arrival to the first token sent to the client",
    ["tenant", "model", "version"],
    buckets=_LATENCY_BUCKETS,
)
E2E = Histogram(
    "gateway_e2e_latency_seconds",
    "Request arrival to the end of the stream",
    ["model", "version"],
    buckets=_LATENCY_BUCKETS,
)
TPOT = Histogram(
    "gateway_time_per_output_token_seconds",
    "First token to the end of the stream, per output token after the first",
    ["model", "version"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
)
OVERHEAD = Histogram(
    "gateway_overhead_seconds",
    "Time the gateway spends before the engine call that produced the first "
    "token (auth, encode, limits, routing, retries)",
    buckets=_OVERHEAD_BUCKETS,
)
STAGE = Histogram(
    "gateway_stage_seconds",
    "Time of each admission step: auth, reserve (request unit + lease, and tokens "
    "on the one-call path), encode (tokenize), take (tokens), route, budget (tenant "
    "budgets), all before the engine call; reserve_overlap: the one-call reservation "
    "when it overlaps the engine's start (overlapped admission), not before it",
    ["stage"],
    buckets=(5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.5),
)
# bound once: the per-request path does no label lookup
(
    STAGE_AUTH,
    STAGE_RESERVE,
    STAGE_RESERVE_OVERLAP,
    STAGE_ENCODE,
    STAGE_ROUTE,
    STAGE_TAKE,
    STAGE_BUDGET,
) = (
    STAGE.labels(s)
    for s in ("auth", "reserve", "reserve_overlap", "encode", "route", "take", "budget")
)
LIMIT_CALLS = Counter(
    "gateway_ratelimit_admissions_total",
    "Admissions by path: 'one' Redis call after the tokenizer (the tenant had headroom), "
    "'two' (request unit and lease before the tokenizer, tokens after)",
    ["path"],
)
OVERLAPPED_ADMISSIONS = Counter(
    "gateway_ratelimit_overlapped_admissions_total",
    "One-call admissions whose Redis reservation overlapped the engine's start (the "
    "tenant had headroom for the request, its lease and its tokens)",
)
OVERLAP_REFUSALS = Counter(
    "gateway_ratelimit_overlap_refusals_total",
    "Overlapped admissions that Redis refused: the engine call was cancelled, nothing charged",
)
MODEL_FALLBACKS = Counter(
    "gateway_model_fallbacks_total",
    "Requests a model route sent past its first target: 'unavailable' (no replica of it "
    "ready), 'context' (the prompt does not fit its context), 'capacity' (every replica of "
    "it at capacity) or 'failure' (it failed before the first token)",
    ["reason"],
)
RETRIES = Counter("gateway_retries_total", "Engine attempts retried on another replica")
FAIR_QUEUE_WAITING = Gauge(
    "gateway_fair_queue_waiting", "Requests waiting in the fair queues for a full model's capacity"
)
FAIR_QUEUE_WAIT = Histogram(
    "gateway_fair_queue_wait_seconds",
    "Time a request waited in a fair queue (every replica of its model full)",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)
FAIR_QUEUE_TIMEOUTS = Counter(
    "gateway_fair_queue_timeouts_total", "Requests refused after waiting the longest wait"
)
FAIR_QUEUE_REFUSED = Counter(
    "gateway_fair_queue_refused_total",
    "Requests refused at once: the fair queue (or the tenant's line in it) was full",
)
FAILOVERS = Counter(
    "gateway_failovers_total",
    "Streams resumed on another replica after their engine failed mid-stream",
)
BREAKER_STATE = Gauge(
    "gateway_breaker_state",
    "Circuit breaker per engine replica: 0 closed, 1 half-open, 2 open",
    ["replica"],
)
RATELIMIT_DENIALS = Counter(
    "gateway_ratelimit_denials_total",
    "Requests denied by tenant limits, per short dimension",
    ["tenant", "dimension"],
)
LOCAL_DENIALS = Counter(
    "gateway_ratelimit_local_denials_total",
    "Request-rate denials answered from the local memo (no Redis call)",
    ["tenant"],
)
AUTH_THROTTLED = Counter(
    "gateway_auth_throttled_total",
    "Calls refused because their client address failed authentication "
    "too often (keys already known valid still pass)",
)
OUTSTANDING = Gauge(
    "gateway_replica_outstanding", "Engine calls in flight per replica", ["replica"]
)
HEALTHY = Gauge("gateway_replica_healthy", "1 when the replica's health is SERVING", ["replica"])
PREFIX_INDEX_BLOCKS = Gauge(
    "gateway_prefix_index_blocks",
    "KV blocks the replica's KV events put in the gateway's prefix index (set every stats "
    "poll; 0 where the engine offers no events)",
    ["replica"],
)
IN_FLIGHT = Gauge("gateway_in_flight", "Generate requests being served")
TOKENIZERS = Gauge(
    "gateway_tokenizers", "Distinct model tokenizers held (fetched from the engines by digest)"
)
VERSION_ATTEMPTS = Counter(
    "gateway_version_attempts_total",
    "Engine attempts per model version by outcome (what the canary guard judges)",
    ["model", "version", "outcome"],
)
ROUTING_DECISIONS = Counter(
    "gateway_routing_decisions_total",
    "Version chosen for admitted requests, and why",
    ["model", "version", "reason"],
)
POLICY_WEIGHT = Gauge(
    "gateway_routing_weight_percent",
    "Share of a model's traffic the routing policy gives a version",
    ["model", "version"],
)
ROLLBACKS = Counter(
    "gateway_routing_rollbacks_total", "Routing policy rollbacks", ["model", "trigger"]
)
SHADOW_REQUESTS = Counter(
    "gateway_shadow_requests_total",
    "Mirrored (shadow) engine calls by final status; output discarded",
    ["model", "version", "code"],
)
SHADOW_TTFT = Histogram(
    "gateway_shadow_time_to_first_token_seconds",
    "Shadow call start to its first token",
    ["model", "version"],
    buckets=_LATENCY_BUCKETS,
)
SHADOW_SKIPPED = Counter(
    "gateway_shadow_skipped_total",
    "Shadow copies not sent (too many in flight, no replica)",
    ["model", "reason"],
)

_M = TypeVar("_M", Counter, Gauge, Histogram)
# the series of the per-request metrics, once looked up: ``labels()`` builds and checks
# a tuple and takes the metric's lock on every call (several per request)
_CHILDREN: dict[tuple[int, tuple[str, ...]], Counter | Gauge | Histogram] = {}
_MAX_CHILDREN = 20_000  # tenants x models x versions x codes; past it, looked up anew


def child(metric: _M, *values: str) -> _M:
    """``metric.labels(*values)``, cached (for series never removed: not the replicas')."""
    key = (id(metric), values)
    found = _CHILDREN.get(key)
    if found is None:
        if len(_CHILDREN) >= _MAX_CHILDREN:
            _CHILDREN.clear()
        found = _CHILDREN[key] = metric.labels(*values)
    return found  # type: ignore[return-value]  # the child of the same metric type


_DIMENSIONS = (
    (Dimension.REQUESTS, "requests"),
    (Dimension.TOKENS, "tokens"),
    (Dimension.CONCURRENCY, "concurrency"),
)


def count_denial(tenant: str, denied: Dimension) -> None:
    """One denial: a count per short dimension."""
    for dim, name in _DIMENSIONS:
        if dim & denied:
            RATELIMIT_DENIALS.labels(tenant, name).inc()


def forget_replica(address: str) -> None:
    """Drop the series of an engine replica that left the pool (its breaker state,
    health, outstanding calls and prefix index), so no alert fires on a replica that is
    gone."""
    for gauge in (BREAKER_STATE, HEALTHY, OUTSTANDING, PREFIX_INDEX_BLOCKS):
        with contextlib.suppress(KeyError):
            gauge.remove(address)
