"""The ``gateway`` config section: listen address, upstreams, limits of a request, resilience.

Loaded with ``load_config(GatewayConfig, "gateway")`` (YAML < ``LLM_GATEWAY_<KEY>``
env < command-line flags). Redis, tenants and keys come from the shared
``ratelimit`` section, so one place configures limits for every process.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl

import yaml

from common.breaker import BreakerPolicy
from common.config import ServiceConfig, deprecated_flat_names
from gateway.routing_policy import policies_from_config
from ratelimit.budget.policy import PriceTable

# the engine protocols an engine entry may name: llm.v1.Engine (ours; also a bare
# host:port), smg-grpc-proto's VllmEngine (``vllm serve --grpc``), TrtllmService
# (``trtllm-serve --grpc``) and SglangScheduler (SGLang's ``--grpc-mode``)
ENGINE_PROTOCOLS = ("llm", "vllm", "trtllm", "sglang")
ENGINE_OPTIONS = ("model", "version")  # what an entry's query may set


PREFIX_WEIGHT = 0.5  # the default [gateway] prefix_weight (KV-event routing)


@dataclass(frozen=True, slots=True)
class EngineEntry:
    """One ``[gateway] engines`` entry: ``[protocol://]host:port[?model=M&version=V]``.

    ``model`` and ``version`` name what a standard engine serves where its own protocol
    does not say it the gateway's way (VllmEngine and TrtllmService have no model version;
    "" = the engine's own name, no version).
    """

    protocol: str
    host: str
    port: int
    model: str = ""
    version: str = ""
    name: str = ""  # the DNS name this address came from ("" = as configured)

    @property
    def tls_name(self) -> str:
        """The name its certificate is checked against: the configured host."""
        return self.name or self.host

    def with_host(self, host: str) -> EngineEntry:
        """The same entry at one address of its DNS name."""
        return EngineEntry(self.protocol, host, self.port, self.model, self.version, self.host)

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        scheme = "" if self.protocol == "llm" else f"{self.protocol}://"
        query = "&".join(f"{k}={getattr(self, k)}" for k in ENGINE_OPTIONS if getattr(self, k))
        return f"{scheme}{host}:{self.port}" + (f"?{query}" if query else "")


def parse_engine_entry(text: str) -> EngineEntry:
    """An engine entry; a bare ``host:port`` (and ``llm://``) is llm.v1.Engine.

    Raises:
        ValueError: the message names the entry and what is wrong with it.
    """
    scheme, sep, rest = text.partition("://")
    if not sep:
        scheme, rest = "llm", text
    if scheme not in ENGINE_PROTOCOLS:
        raise ValueError(
            f"[gateway] engines: {text!r} names protocol {scheme!r}; use one of "
            + ", ".join(f"{p}://" for p in ENGINE_PROTOCOLS)
            + " (a bare host:port is llm://)"
        )
    where, _, query = rest.partition("?")
    host, _, port = where.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"[gateway] engines: {text!r} is not [protocol://]host:port")
    try:
        options = dict(parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query)))
    except ValueError:
        raise ValueError(f"[gateway] engines: {text!r}: the query is not key=value&...") from None
    unknown = sorted(set(options) - set(ENGINE_OPTIONS))
    if options and scheme == "llm":
        raise ValueError(
            f"[gateway] engines: {text!r}: an llm.v1 engine reports its own model and "
            "version; ?model= and ?version= are for vllm://, trtllm:// and sglang:// entries"
        )
    if unknown:
        raise ValueError(
            f"[gateway] engines: {text!r} sets {unknown}; an entry may set only "
            f"{list(ENGINE_OPTIONS)}"
        )
    return EngineEntry(scheme, host, int(port), **options)


TOOL_PARSERS = ("hermes", "llama3_json", "mistral")
REASONING_PARSERS = ("think",)


def _per_model(value: Any, key: str, allowed: tuple[str, ...]) -> dict[str, str]:
    """A model -> name table (a YAML/JSON string from the environment), names checked."""
    if isinstance(value, str):
        value = yaml.safe_load(value) or {}
    if not isinstance(value, dict):
        raise ValueError(f"[gateway] {key} must map model names to one of {', '.join(allowed)}")
    for model, name in value.items():
        if name not in allowed:
            raise ValueError(
                f"[gateway] {key}[{model!r}] must be one of {', '.join(allowed)}, got {name!r}"
            )
    return {str(k): str(v) for k, v in value.items()}


@dataclass(slots=True)
class GatewayConfig(ServiceConfig):
    """Settings of one gateway replica.

    Attributes:
        engines: Engine replicas, each ``[protocol://]host:port``: a bare ``host:port``
            (or ``llm://``) speaks llm.v1.Engine, ``vllm://`` VllmEngine (``vllm serve
            --grpc``), ``trtllm://`` TrtllmService (``trtllm-serve --grpc``), ``sglang://``
            SglangScheduler (SGLang's ``--grpc-mode``); a query
            ``?model=M&version=V`` names a standard engine's model and version
            (docs/engine-protocols.md). A DNS name stands for each address it resolves to.
        engine_tls_ca_file: CA bundle that engine certificates must chain to; set, every
            engine channel is TLS ("" = plaintext engine channels).
        engine_tls_cert_file / engine_tls_key_file: The gateway's client certificate and
            key for engines that require mutual TLS (both or neither; need the CA file).
        engine_tls_server_name: The name engine certificates are checked against ("" =
            each entry's host; a DNS name's addresses are checked against the name).
        tokenizer: Address of tokenizer_svc (``host:port``).
        model_dir: A tokenizer for engines that serve none ("" = none: every model's
            tokenizer comes from its engines, ``Engine.GetTokenizer``).
        default_model: Model served when a request leaves ``model`` empty
            ("" = the model most replicas report).
        default_max_tokens: Output budget when a request sets ``max_tokens`` 0
            (capped by the model's context).
        max_max_tokens: Largest ``max_tokens`` a request may ask for (0 = the context).
        request_timeout_s: Deadline of a request without a client deadline.
        max_request_timeout_s: Longest deadline a client may ask for (``grpc-timeout``,
            ``x-request-timeout``); longer ones are cut to this.
        encode_timeout_s: Budget of one tokenizer call.
        tokenize_in_process: Encode prompts in the gateway (the same code and
            tokenizer files as tokenizer_svc; no RPC on the hot path) instead of
            calling tokenizer_svc.
        overlap_admission: For a tenant whose last admissions left headroom (requests,
            leases and tokens, as this replica saw them), start the engine while the
            one Redis reservation is in flight; its first chunk waits for the answer,
            and a refusal cancels the engine call (nothing is charged). False = the
            reservation always comes first.
        auth_failures_per_minute / auth_failure_burst: Failed authentications one
            client address may make (a token bucket); past that its calls with keys
            not already known valid get RESOURCE_EXHAUSTED until the bucket refills
            (0 = no limit).
        max_attempts: Engine attempts before the first token (1 = no retries).
        retry_backoff_base_ms / retry_backoff_max_ms: Full-jitter exponential backoff.
        retry_budget_ratio: Retries allowed as a share of requests (0.2 = 20% extra load).
        retry_budget_min: Retries always allowed per window, whatever the traffic.
        retry_budget_window_s: Window the retry budget is counted over.
        failover: Resume a stream on another replica when its engine fails mid-stream.
        max_failovers: Mid-stream failovers per request.
        queue_max_wait_ms: When every replica of a model is full, how long a request
            waits in the per-tenant fair queue (``gateway.fleet.fair_queue``) before it
            is refused (0 = refuse at once).
        queue_max_waiting / queue_max_waiting_per_tenant: Requests waiting at most, in
            all and per tenant, per model (past that: refused at once).
        breaker: Per-replica circuit breaker thresholds (``common.breaker.BreakerPolicy``);
            its knobs were the flat ``breaker_<knob>`` keys of this section before
            (still read, with a deprecation warning, for this release).
        max_ejected_fraction: At most this share of replicas (at least one) open at once.
        stats_interval_s: How often each replica's GetStats is polled.
        queue_weight / kv_weight: Routing score weights (see ``gateway.fleet.replica_pool``).
        prefix_weight: How much a replica's prefix cache counts in routing, 0 to 1: its
            load score is multiplied by ``1 - prefix_weight * cached / prompt``, where the
            cached share comes from the engine's KV events (``vllm://``, ``trtllm://``,
            ``sglang://``; 0 = ignore them).
        tenant_shard_size: Each tenant's requests go to this many replicas of a model
            (its shard, by rendezvous hashing), others only when none of those can take
            the attempt, so one tenant's flood does not fill every replica (0 = off).
        startup_wait_s: How long start-up waits for one SERVING engine before
            reporting SERVING anyway (requests then get UNAVAILABLE until one is up).
        discovery_interval_s: How often engine entries that are DNS names are
            resolved again (each address is a replica; see ``gateway.fleet.discovery``).
        routing_policies: Initial routing policy per model (model -> mapping, see
            ``gateway.routing_policy``; a YAML/JSON string from the environment). Seeded
            into Redis for models without a policy there; the admin API changes it.
        routing_policy_cache_ms: Longest time a replica routes by a policy or a model
            route without re-reading Redis (another replica's change takes effect within it).
        guard_interval_s: Period of the canary guard's pass.
        shadow_max_in_flight: Shadow copies allowed at once per gateway replica.
        http_port: The OpenAI-compatible HTTP front (``gateway.fronts.http``) on ``host``
            (0 = an ephemeral port, -1 = no HTTP front).
        http_body_timeout_s: Longest a request body may take to arrive on the HTTP front
            once its headers are in (408 and the connection closes past it; 0 = no limit).
        http_max_bodies_per_tenant: Request bodies one tenant may have arriving at once
            on one gateway process (429 past it; 0 = no cap). A tenant's
            ``max_concurrent`` caps it too: nothing of its limits is held until the body
            is in, so slow bodies would otherwise be free. A body in within 0.2 s of
            its headers takes no slot.
        trusted_proxies: Addresses or CIDR blocks of the proxies in front (Envoy's):
            only on a connection from one of them does ``x-forwarded-for`` name the
            client (its last hop), on both fronts; from anywhere else the peer is the
            client, so a caller of the gateway's own ports cannot pick the address the
            failed-auth throttle counts ([] = trust no one).
        workers: Processes serving this replica's ports (``gateway.workers``): 1 = this
            process serves them; N > 1 = a supervisor and N worker processes sharing the
            gRPC and HTTP ports (SO_REUSEPORT: the kernel spreads connections, not the
            streams of one HTTP/2 connection), each one a replica in every other way
            (its own admission view, breakers and queues), the metrics of all of them
            on the supervisor's metrics port with a ``worker`` label.
        prices: USD per million tokens per model, for cost budgets (model ->
            ``{prompt_per_million, completion_per_million}``; ``"*"`` = every other
            model; a YAML/JSON string from the environment). Unpriced models cost 0.
        max_guided_chars: The most characters of one guided-decoding constraint a
            request may send (``response_format``'s JSON schema, a regex, a grammar, a
            choice list, a tool's parameters schema); longer ones are refused with 400.
        tool_parsers: The tool-call parser per model (model -> ``hermes`` |
            ``llama3_json`` | ``mistral``; ``"*"`` = every other model). Unset: the one
            the model's chat template implies (``[TOOL_CALLS]`` -> mistral,
            ``<|python_tag|>`` -> llama3_json), else hermes (the default tool prompt's).
        reasoning_parsers: Models whose output marks a thought (model -> ``think``:
            ``<think>...</think>`` goes to ``reasoning_content``; ``"*"`` = every other
            model). Unset: none (off).
        max_n: The most parallel samples one request may ask for (``n``); each is
            admitted and counted as a request of its own.
    """

    port: int = 50051
    grace_seconds: float = 30.0
    engines: list[str] = field(default_factory=lambda: ["127.0.0.1:50071"])
    engine_tls_ca_file: str = ""
    engine_tls_cert_file: str = ""
    engine_tls_key_file: str = ""
    engine_tls_server_name: str = ""
    tokenizer: str = "127.0.0.1:50061"
    model_dir: str = ""
    default_model: str = ""
    default_max_tokens: int = 256
    max_max_tokens: int = 0
    request_timeout_s: float = 600.0
    max_request_timeout_s: float = 3600.0
    encode_timeout_s: float = 10.0
    tokenize_in_process: bool = True
    overlap_admission: bool = True
    auth_failures_per_minute: int = 30
    auth_failure_burst: int = 20
    max_attempts: int = 3
    retry_backoff_base_ms: int = 25
    retry_backoff_max_ms: int = 250
    retry_budget_ratio: float = 0.2
    retry_budget_min: int = 3
    retry_budget_window_s: float = 10.0
    failover: bool = True
    max_failovers: int = 2
    queue_max_wait_ms: int = 2000
    queue_max_waiting: int = 1024
    queue_max_waiting_per_tenant: int = 256
    breaker: BreakerPolicy = field(
        default_factory=BreakerPolicy, metadata=deprecated_flat_names("breaker_")
    )
    max_ejected_fraction: float = 0.5
    stats_interval_s: float = 0.5
    queue_weight: float = 1.0
    kv_weight: float = 1.0
    prefix_weight: float = PREFIX_WEIGHT
    tenant_shard_size: int = 0
    startup_wait_s: float = 60.0
    discovery_interval_s: float = 10.0
    routing_policies: dict[str, Any] = field(default_factory=dict)
    routing_policy_cache_ms: int = 1000
    guard_interval_s: float = 2.0
    shadow_max_in_flight: int = 8
    http_port: int = 8000
    http_body_timeout_s: float = 10.0
    http_max_bodies_per_tenant: int = 4
    trusted_proxies: list[str] = field(default_factory=list)
    workers: int = 1
    prices: dict[str, Any] = field(default_factory=dict)
    max_guided_chars: int = 65_536
    tool_parsers: dict[str, str] = field(default_factory=dict)
    reasoning_parsers: dict[str, str] = field(default_factory=dict)
    max_n: int = 8

    def __post_init__(self) -> None:
        if not self.engines:
            raise ValueError("[gateway] engines is empty: list at least one host:port")
        for addr in self.engines:
            parse_engine_entry(addr)
        self._validate_engine_tls()
        if not 0.0 <= self.prefix_weight <= 1.0:
            raise ValueError(
                f"[gateway] prefix_weight must be between 0 and 1, got {self.prefix_weight}"
            )
        if not self.request_timeout_s <= self.max_request_timeout_s < float("inf"):
            raise ValueError(
                "[gateway] max_request_timeout_s must be finite and >= "
                f"request_timeout_s ({self.request_timeout_s}), got "
                f"{self.max_request_timeout_s}"
            )
        positive = (
            "default_max_tokens",
            "request_timeout_s",
            "encode_timeout_s",
            "max_attempts",
            "stats_interval_s",
            "retry_budget_window_s",
            "guard_interval_s",
            "auth_failure_burst",
            "queue_max_waiting",
            "queue_max_waiting_per_tenant",
            "workers",
            "max_guided_chars",
            "max_n",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"[gateway] {name} must be > 0, got {getattr(self, name)}")
        for name in (
            "max_max_tokens",
            "max_failovers",
            "retry_budget_min",
            "retry_backoff_base_ms",
            "retry_backoff_max_ms",
            "startup_wait_s",
            "routing_policy_cache_ms",
            "shadow_max_in_flight",
            "auth_failures_per_minute",
            "queue_max_wait_ms",
            "tenant_shard_size",
            "http_body_timeout_s",
            "http_max_bodies_per_tenant",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"[gateway] {name} must be >= 0, got {getattr(self, name)}")
        if self.http_port < -1:
            raise ValueError(f"[gateway] http_port must be >= -1 (-1 = off), got {self.http_port}")
        for name in ("retry_budget_ratio", "max_ejected_fraction"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"[gateway] {name} must be in [0, 1], got {getattr(self, name)}")
        self._validate_breaker()
        self._parse_routing_policies()
        self._parse_prices()
        self.tool_parsers = _per_model(self.tool_parsers, "tool_parsers", TOOL_PARSERS)
        self.reasoning_parsers = _per_model(
            self.reasoning_parsers, "reasoning_parsers", REASONING_PARSERS
        )

    def parser_of(self, table: dict[str, str], model: str) -> str:
        """A per-model setting (``tool_parsers``, ``reasoning_parsers``): the model's, or
        ``"*"``'s, or ""."""
        return table.get(model, table.get("*", ""))

    def _validate_engine_tls(self) -> None:
        pair = (self.engine_tls_cert_file, self.engine_tls_key_file)
        if any(pair) and not all(pair):
            raise ValueError(
                "[gateway] engine_tls_cert_file and engine_tls_key_file go together: "
                "set both for mutual TLS to the engines, or neither"
            )
        if any(pair) and not self.engine_tls_ca_file:
            raise ValueError(
                "[gateway] engine_tls_cert_file needs engine_tls_ca_file (the CA the "
                "engines' certificates chain to)"
            )

    def _validate_breaker(self) -> None:
        try:
            self.breaker.validate()
        except ValueError as e:
            raise ValueError(f"[gateway.breaker] {e}") from None

    def _parse_prices(self) -> None:
        if isinstance(self.prices, str):
            self.prices = yaml.safe_load(self.prices) or {}
        if not isinstance(self.prices, dict):
            raise ValueError("[gateway] prices must map model names to prices")
        try:
            PriceTable.parse(self.prices)
        except (TypeError, ValueError) as e:
            raise ValueError(f"[gateway] prices: {e}") from None

    def price_table(self) -> PriceTable:
        """The parsed ``prices``."""
        return PriceTable.parse(self.prices)

    def _parse_routing_policies(self) -> None:
        raw: Any = self.routing_policies
        if isinstance(raw, str):
            raw = yaml.safe_load(raw) or {}
        if not isinstance(raw, dict):
            raise ValueError("[gateway] routing_policies must map model names to policies")
        policies_from_config(raw)  # raises ValueError naming the model and the key
        self.routing_policies = raw
