"""Per-tenant rate limits on Redis: token buckets, concurrency leases, API keys, admin API.

What the gateway uses (one ``RateLimitStack`` per process)::

    from common.config import load_config
    from ratelimit import RateLimitConfig, RateLimitStack, KeyRole
    from ratelimit.status import abort_denied, status_for

    stack = RateLimitStack.from_config(load_config(RateLimitConfig, "ratelimit"))
    await stack.start()                                   # scripts + admin key
    principal = await stack.registry.authenticate(key)    # UnauthenticatedError /
    tenant = principal.tenant                             #   PermissionDeniedError
    decision = await stack.limiter.reserve(tenant, prompt_tokens + max_tokens)
    if not decision.allowed:
        await abort_denied(context, decision)             # RESOURCE_EXHAUSTED + retry-after-ms
    async with stack.limiter.keep_alive(decision.reservation):
        ...                                               # stream
    await stack.limiter.settle(decision.reservation,
                               prompt_tokens=p, completion_tokens=c)
    # or, when nothing is known about usage: await stack.limiter.release(...)
    stack.servicer()                                      # RateLimitAdmin to mount

Module map: ``config`` (policies, settings), ``limiter/`` (``algorithm``: pure
bucket math; ``lua``: the Redis scripts; ``storage/``: the ``Store`` protocol, Redis
and memory stores; ``rate_limiter``: reserve/settle/leases, fail modes;
``decision``, ``denials``, ``membership``), ``store_guard`` (time budget and circuit
breaker of every Redis call), ``redis_scripts`` (EVALSHA, reload on NOSCRIPT, batching),
``tenancy/`` (``records``, ``registry``, ``key_cache``: cached authentication,
``bearer``: the credential parser, ``audit``), ``budget/`` (``policy``: budgets and
prices; ``ledger``: reserve/settle in Redis), ``usage/`` (``records``: usage per
tenant, key, model, version and day), ``admin/`` (the RateLimitAdmin servicer, its
calls and converters), ``redis_client`` (one server or a cluster, and which errors
are the store's), ``errors``, ``status`` (gRPC statuses), ``metrics``, ``factory``,
``__main__`` (the admin service alone). The Redis server launchers and the ACL are
``common.redis_server``, ``common.redis_cluster`` and ``common.redis_acl``; the load
generator of the exactness tests and the benchmark is ``bench.loadlib.hammer``.
"""

from typing import TYPE_CHECKING, Any

from ratelimit.config import Dimension, LimitPolicy, Priority, RateLimitConfig, Tenant
from ratelimit.errors import (
    AuthError,
    LimiterUnavailableError,
    NotFoundError,
    PermissionDeniedError,
    StoreError,
    UnauthenticatedError,
)
from ratelimit.limiter.decision import Decision, Reservation
from ratelimit.limiter.rate_limiter import RateLimiter
from ratelimit.tenancy.records import ApiKey, KeyRole, Principal
from ratelimit.tenancy.registry import Registry

if TYPE_CHECKING:
    from ratelimit.factory import RateLimitStack


def __getattr__(name: str) -> Any:
    # The factory pulls in grpc and the generated stubs; import it only when
    # asked, so ``common.redis_server`` stays usable without them.
    if name == "RateLimitStack":
        from ratelimit.factory import RateLimitStack

        return RateLimitStack
    raise AttributeError(f"module 'ratelimit' has no attribute {name!r}")


__all__ = [
    "ApiKey",
    "AuthError",
    "Decision",
    "Dimension",
    "KeyRole",
    "LimitPolicy",
    "LimiterUnavailableError",
    "NotFoundError",
    "PermissionDeniedError",
    "Principal",
    "Priority",
    "RateLimitConfig",
    "RateLimitStack",
    "RateLimiter",
    "Registry",
    "Reservation",
    "StoreError",
    "Tenant",
    "UnauthenticatedError",
]
