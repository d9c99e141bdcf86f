"""Prometheus metrics of the limiter, the registry and the admin service.

Tenant labels appear only on denial counters: tenants are a bounded set of
teams, and "who is being throttled" is the question ops ask first.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

DECISIONS = Counter(
    "ratelimit_decisions_total",
    "Admission decisions by outcome (allowed, denied, shadow_denied, unavailable) and source "
    "(redis, local fallback).",
    ["outcome", "source"],
)
DENIALS = Counter(
    "ratelimit_denials_total",
    "Denied (or shadow-denied) requests per tenant and limited dimension.",
    ["tenant", "dimension", "shadow"],
)
DECISION_SECONDS = Histogram(
    "ratelimit_decision_seconds",
    "Latency of one reserve() call, fallback included.",
    ["source"],
    buckets=(0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
)
STORE_ERRORS = Counter(
    "ratelimit_store_errors_total",
    "Store failures by operation and kind (timeout, error).",
    ["op", "kind"],
)
LIVE_REPLICAS = Gauge(
    "ratelimit_live_replicas",
    "Gateway replicas sharing the limits, as last counted in Redis (divides the fail-open share).",
)
BREAKER_STATE = Gauge(
    "ratelimit_breaker_state",
    "Redis circuit breaker: 0 closed, 1 half-open, 2 open.",
)
SETTLE_SKIPPED = Counter(
    "ratelimit_settle_skipped_total",
    "Settlements that could not reach the store (their leases expire by TTL instead).",
)
COMPENSATIONS = Counter(
    "ratelimit_compensations_total",
    "Reserves with an unknown outcome (timeout, cancel) undone by lease id: refunded "
    "(the reserve had run), nothing_held (it had not), failed (store unreachable).",
    ["result"],
)
LEASES_LOST = Counter(
    "ratelimit_leases_lost_total",
    "Heartbeats that found their lease already expired.",
)
AUTH_RESULTS = Counter(
    "ratelimit_auth_total",
    "API key checks by result (ok, unknown, revoked, expired, wrong_role, malformed).",
    ["result"],
)
ADMIN_REQUESTS = Counter(
    "ratelimit_admin_requests_total",
    "RateLimitAdmin calls by method and status code.",
    ["method", "code"],
)
BUDGET_EVENTS = Counter(
    "ratelimit_budget_events_total",
    "Budget checks that crossed a threshold, per tenant and budget: warned (past the soft "
    "threshold), refused (hard limit), shadow_refused (over the limit, admitted in shadow "
    "mode).",
    ["tenant", "budget", "event"],
)
BUDGET_USED_RATIO = Gauge(
    "ratelimit_budget_used_ratio",
    "Share of each budget counted in its current period after the last admission on this "
    "replica (reservations included; 1 = exhausted).",
    ["tenant", "budget"],
)
BUDGET_UNCHECKED = Counter(
    "ratelimit_budget_unchecked_total",
    "Budget calls that could not reach Redis: charge (admitted unchecked when failing "
    "open) and settle (the reservation stays charged).",
    ["op"],
)
USAGE_WRITTEN = Counter(
    "ratelimit_usage_records_written_total",
    "Finished requests written to the usage records (tenant x key x model x version x day).",
)
USAGE_DROPPED = Counter(
    "ratelimit_usage_records_dropped_total",
    "Finished requests dropped from the usage records because the write queue was full "
    "(Redis unreachable for longer than the queue lasts).",
)
SCRIPT_CALLS = Counter(
    "ratelimit_script_calls_total",
    "Limiter script calls (reserve, take, settle, heartbeat, ...) sent to Redis.",
)
SCRIPT_ROUND_TRIPS = Counter(
    "ratelimit_script_round_trips_total",
    "Round trips those calls took: calls made while one was in flight share the next "
    "(one pipeline), so calls / round trips is the batching factor under load.",
)
