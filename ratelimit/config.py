"""Limit policies, tenants and deployment settings as validated, immutable values.

Everything here is parsed and checked once; the limiter, the stores and the
Lua script only ever see a ``LimitPolicy`` that is known to be consistent, so
they never re-validate on the hot path (envoy ratelimit ``config``: parse,
validate, then hand out a snapshot).
"""

from __future__ import annotations

import dataclasses
import enum
import re
from dataclasses import dataclass

from common.config import ServiceConfig
from common.redis_nodes import parse_node
from ratelimit.budget.policy import Budget, validate_budgets

# Levels are doubles in Lua and Python; integers up to 2**53 stay exact.
MAX_LIMIT = 2**53
TENANT_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


class Priority(enum.IntEnum):
    """Scheduling class of a tenant; values match ``llm.v1.Priority``."""

    UNSPECIFIED = 0
    LOW = 1
    NORMAL = 2
    CRITICAL = 3


class Dimension(enum.IntFlag):
    """Limited dimensions; a denial names every dimension that was short."""

    NONE = 0
    REQUESTS = 1
    TOKENS = 2
    CONCURRENCY = 4


@dataclass(frozen=True, slots=True)
class LimitPolicy:
    """Per-tenant limits. 0 means unlimited for every field.

    Requests and tokens are token buckets that refill continuously at
    ``*_per_minute / 60000`` per millisecond up to their capacity (the burst,
    or one minute's worth when the burst is 0). ``max_concurrent`` bounds the
    number of live leases (streams in flight).
    """

    requests_per_minute: int = 0
    tokens_per_minute: int = 0
    max_concurrent: int = 0
    request_burst: int = 0
    token_burst: int = 0

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{field.name} must be an integer, got {value!r}")
            if not 0 <= value <= MAX_LIMIT:
                raise ValueError(f"{field.name} must be between 0 and 2**53, got {value}")
        if self.request_burst and not self.requests_per_minute:
            raise ValueError("request_burst is set but requests_per_minute is 0 (unlimited)")
        if self.token_burst and not self.tokens_per_minute:
            raise ValueError("token_burst is set but tokens_per_minute is 0 (unlimited)")

    @property
    def request_capacity(self) -> int:
        """Size of the request bucket (0 = unlimited)."""
        return self.request_burst or self.requests_per_minute

    @property
    def token_capacity(self) -> int:
        """Size of the token bucket (0 = unlimited)."""
        return self.token_burst or self.tokens_per_minute

    @property
    def unlimited(self) -> bool:
        """True when no dimension is limited."""
        return not (self.requests_per_minute or self.tokens_per_minute or self.max_concurrent)

    def divided(self, num_replicas: int) -> LimitPolicy:
        """This policy split evenly over ``num_replicas`` processes (fail-open share).

        Each limited field keeps at least 1 so a share never becomes unlimited.
        """
        if num_replicas <= 1:
            return self

        def share(value: int) -> int:
            return max(1, value // num_replicas) if value else 0

        return LimitPolicy(
            requests_per_minute=share(self.requests_per_minute),
            tokens_per_minute=share(self.tokens_per_minute),
            max_concurrent=share(self.max_concurrent),
            request_burst=share(self.request_burst),
            token_burst=share(self.token_burst),
        )

    def fallback_share(self, num_replicas: int, num_tokens: int) -> LimitPolicy:
        """The fail-open share, with a token burst that still fits one request.

        A request that fits the shared bucket must not become impossible just
        because the share's burst is smaller: the burst grows to ``num_tokens``
        (the refill rate stays divided, so the sustained rate is unchanged).
        """
        share = self.divided(num_replicas)
        if share.tokens_per_minute and share.token_capacity < num_tokens <= self.token_capacity:
            share = dataclasses.replace(share, token_burst=num_tokens)
        return share


def validate_tenant_id(tenant_id: str) -> str:
    """Return ``tenant_id`` or raise ValueError.

    Ids are 1-64 characters of ``[A-Za-z0-9._-]``: no ``{``/``}`` (they would
    break the Redis Cluster hash tag) and no ``:`` (the key separator).
    """
    if not TENANT_ID_RE.match(tenant_id):
        raise ValueError(
            f"invalid tenant id {tenant_id!r}: use 1-64 characters of letters, digits, "
            "'.', '_' or '-', starting with a letter or digit"
        )
    return tenant_id


MAX_FAIR_SHARE = 100


@dataclass(frozen=True, slots=True)
class Tenant:
    """A team calling the gateway: its limits, budgets, priority and allowed models."""

    tenant_id: str
    limits: LimitPolicy = LimitPolicy()
    priority: Priority = Priority.NORMAL
    allowed_models: tuple[str, ...] = ()
    shadow_mode: bool = False
    display_name: str = ""
    created_at: float = 0.0  # unix seconds
    updated_at: float = 0.0
    budgets: tuple[Budget, ...] = ()
    fair_share: int = 1  # share of the engines within its class when others are busy
    # tenants naming the same group share prefix-cache blocks; "" = its own cache
    prefix_cache_group: str = ""

    def __post_init__(self) -> None:
        validate_tenant_id(self.tenant_id)
        if self.prefix_cache_group and not TENANT_ID_RE.match(self.prefix_cache_group):
            raise ValueError(
                f"tenant {self.tenant_id!r}: invalid prefix_cache_group "
                f"{self.prefix_cache_group!r}: use 1-64 characters of letters, digits, '.', "
                "'_' or '-', starting with a letter or digit (or \"\" for the tenant's own cache)"
            )
        validate_budgets(f"tenant {self.tenant_id!r}", self.budgets)
        if not 1 <= self.fair_share <= MAX_FAIR_SHARE:
            raise ValueError(
                f"tenant {self.tenant_id!r}: fair_share must be 1-{MAX_FAIR_SHARE} "
                f"(0 = 1), got {self.fair_share}"
            )

    @property
    def cache_salt(self) -> str:
        """The prefix-cache salt of its requests: its group's, else its own, so engines
        reuse KV blocks (and report cached tokens) only within a tenant or a group an
        admin declared."""
        if self.prefix_cache_group:
            return f"group:{self.prefix_cache_group}"
        return f"tenant:{self.tenant_id}"

    def allows_model(self, model: str) -> bool:
        """True when the tenant may call ``model`` (an empty list allows every model)."""
        return not self.allowed_models or model in self.allowed_models


FAIL_MODES = ("open", "closed")


@dataclass(slots=True)
class RateLimitConfig(ServiceConfig):
    """The ``ratelimit`` section: Redis, timeouts, failure mode, leases, auth cache.

    The gateway loads the same section (``load_config(RateLimitConfig,
    "ratelimit")``) so one place configures limits for every process; the port keys
    are those of the standalone admin service (``python -m ratelimit``).

    Attributes:
        redis_url: The Redis server (with ``redis_cluster``: one seed node of the cluster).
        redis_username: Redis ACL user (e.g. ``llm``); "" = the URL's user, else none.
        redis_password_file: File holding that user's password (a mounted Secret).
        redis_cluster: Redis Cluster: redis-py's cluster client routes each call to its
            slot's primary, ``redis_url`` being one seed node.
        redis_startup_nodes: More seed nodes of the cluster, as ``host:port``.
        key_prefix: Prefix of every Redis key (no ``{`` or ``}``: hash tags).
        timeout_ms: Budget for one limiter call to Redis.
        pool_size: Redis connections per process.
        fail_mode: Redis unreachable: ``open`` = local buckets (each tenant's policy
            divided by the live gateway replicas); ``closed`` = UNAVAILABLE.
        num_replicas: The fail-open divisor until the live replica count is read from Redis.
        replica_ttl_ms: A gateway not heard from for this long stops counting as live
            (each refreshes its entry every third of it).
        breaker_failures: Consecutive Redis errors that open the limiter's breaker.
        breaker_open_ms: How long an open breaker skips Redis before one probe.
        lease_ttl_ms: A concurrency lease not heartbeated for this long is reclaimed.
        concurrency_retry_ms: Retry-after hint of concurrency denials.
        auth_cache_ttl_ms: Bound on how long a revoked key or an old policy is honoured
            (every replica re-reads within it).
        audit_max_events: Admin audit events kept.
        usage_retention_days: How long per-day usage records (tenant x key x model x
            version) are kept.
        admin_key: Bootstrap admin key (plaintext), registered at start; "" =
            ``$ADMIN_KEY``, else the key in ``admin_key_file``.
        admin_key_file: File holding the bootstrap admin key (read when neither
            ``admin_key`` nor ``$ADMIN_KEY`` is set).
    """

    port: int = 50081
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_username: str = ""
    redis_password_file: str = ""
    redis_cluster: bool = False
    redis_startup_nodes: list[str] = dataclasses.field(default_factory=list)
    key_prefix: str = "rl:"
    timeout_ms: int = 100
    pool_size: int = 64
    fail_mode: str = "open"
    num_replicas: int = 1
    replica_ttl_ms: int = 15_000
    breaker_failures: int = 3
    breaker_open_ms: int = 2000
    lease_ttl_ms: int = 30_000
    concurrency_retry_ms: int = 1000
    auth_cache_ttl_ms: int = 5000
    audit_max_events: int = 10_000
    usage_retention_days: int = 400
    admin_key: str = ""
    admin_key_file: str = ""

    def __post_init__(self) -> None:
        if self.fail_mode not in FAIL_MODES:
            raise ValueError(
                f"[ratelimit] fail_mode must be one of {FAIL_MODES}, got {self.fail_mode!r}"
            )
        positive = (
            "timeout_ms",
            "pool_size",
            "num_replicas",
            "replica_ttl_ms",
            "breaker_failures",
            "breaker_open_ms",
            "lease_ttl_ms",
            "concurrency_retry_ms",
            "audit_max_events",
            "usage_retention_days",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"[ratelimit] {name} must be > 0, got {getattr(self, name)}")
        if self.auth_cache_ttl_ms < 0:
            raise ValueError("[ratelimit] auth_cache_ttl_ms must be >= 0")
        if self.redis_startup_nodes and not self.redis_cluster:
            raise ValueError(
                "[ratelimit] redis_startup_nodes are seeds of a Redis Cluster; "
                "set redis_cluster: true (or remove them)"
            )
        for node in self.redis_startup_nodes:
            parse_node(node)  # ValueError names the bad entry
        if "{" in self.key_prefix or "}" in self.key_prefix:
            raise ValueError("[ratelimit] key_prefix must not contain '{' or '}' (hash tags)")
