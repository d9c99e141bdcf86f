"""Builds the rate-limit components from ``RateLimitConfig`` (gateway and standalone).

    stack = RateLimitStack.from_config(load_config(RateLimitConfig, "ratelimit"))
    await stack.start()          # loads the Lua scripts, bootstraps the admin key
    stack.registry.authenticate(key) / stack.limiter.reserve(tenant, n) / ...
    await stack.aclose()

One Redis connection pool (one per node of a Redis Cluster) serves the
limiter, the registry and the audit log. The client never retries more than
once itself (the limiter has its own time budget and breaker); socket timeouts
are a backstop above that budget.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from common.log import get_logger
from common.service_auth import read_secret_file
from ratelimit.admin.servicer import RateLimitAdminServicer
from ratelimit.budget.ledger import BudgetLedger
from ratelimit.config import RateLimitConfig
from ratelimit.errors import StoreError
from ratelimit.limiter.membership import ReplicaMembership
from ratelimit.limiter.rate_limiter import RateLimiter
from ratelimit.limiter.storage.memory import MemoryStore
from ratelimit.limiter.storage.redis import RedisStore
from ratelimit.redis_client import RedisClient, connect
from ratelimit.store_guard import store_breaker
from ratelimit.tenancy.audit import AuditLog
from ratelimit.tenancy.registry import Registry
from ratelimit.usage.records import UsageLog

log = get_logger(__name__)


def backstop_s(config: RateLimitConfig) -> float:
    """Socket and background-call timeout: well above the per-call budget, at least 1 s."""
    return max(1.0, 10 * config.timeout_ms / 1000.0)


def make_client(config: RateLimitConfig) -> RedisClient:
    """A pooled ``redis.asyncio`` client with ``decode_responses=True``: one server, or
    the cluster client when ``redis_cluster`` is set (``ratelimit.redis_client``)."""
    backstop = backstop_s(config)
    password = read_secret_file(config.redis_password_file, "redis_password_file")
    return connect(
        config.redis_url,
        cluster=config.redis_cluster,
        startup_nodes=config.redis_startup_nodes,
        username=config.redis_username or None,
        password=password or None,
        decode_responses=True,
        max_connections=config.pool_size,
        socket_timeout=backstop,
        socket_connect_timeout=backstop,
        retry=Retry(NoBackoff(), 1),
    )


def bootstrap_admin_key(config: RateLimitConfig) -> str:
    """The admin key to register at start: config, then $ADMIN_KEY, then the key file."""
    if config.admin_key:
        return config.admin_key
    if os.environ.get("ADMIN_KEY"):
        return os.environ["ADMIN_KEY"]
    if config.admin_key_file and Path(config.admin_key_file).exists():
        return Path(config.admin_key_file).read_text().strip()
    return ""


@dataclass(slots=True)
class RateLimitStack:
    """Everything the gateway (or ``python -m ratelimit``) needs, sharing one pool."""

    config: RateLimitConfig
    client: RedisClient
    store: RedisStore
    limiter: RateLimiter
    registry: Registry
    audit: AuditLog
    membership: ReplicaMembership
    budgets: BudgetLedger
    usage: UsageLog

    @classmethod
    def from_config(cls, config: RateLimitConfig) -> RateLimitStack:
        """Wire the components; no I/O happens until ``start``."""
        client = make_client(config)
        store = RedisStore(
            client,
            prefix=config.key_prefix,
            lease_ttl_ms=config.lease_ttl_ms,
            concurrency_retry_ms=config.concurrency_retry_ms,
            batch_timeout_ms=config.timeout_ms,
        )
        limiter = RateLimiter(
            store,
            fail_mode=config.fail_mode,
            timeout_ms=config.timeout_ms,
            num_replicas=config.num_replicas,
            breaker=store_breaker(config.breaker_failures, config.breaker_open_ms),
            fallback=MemoryStore(
                lease_ttl_ms=config.lease_ttl_ms,
                concurrency_retry_ms=config.concurrency_retry_ms,
            ),
        )
        return cls(
            config=config,
            client=client,
            store=store,
            limiter=limiter,
            registry=Registry(
                client, prefix=config.key_prefix, auth_cache_ttl_ms=config.auth_cache_ttl_ms
            ),
            audit=AuditLog(client, prefix=config.key_prefix, max_events=config.audit_max_events),
            membership=ReplicaMembership(
                client,
                prefix=config.key_prefix,
                ttl_ms=config.replica_ttl_ms,
                on_count=limiter.set_live_replicas,
                timeout_s=backstop_s(config),
            ),
            budgets=BudgetLedger(client, limiter.guard, prefix=config.key_prefix),
            usage=UsageLog(
                client, prefix=config.key_prefix, retention_days=config.usage_retention_days
            ),
        )

    def servicer(self) -> RateLimitAdminServicer:
        """The RateLimitAdmin servicer over these components."""
        return RateLimitAdminServicer(
            self.registry, self.limiter, self.audit, self.budgets, self.usage
        )

    async def start(self, wait_s: float = 60.0) -> None:
        """Wait for Redis (up to ``wait_s``), load the scripts, register the admin key."""
        deadline = asyncio.get_running_loop().time() + wait_s
        while True:
            try:
                await self.store.load_scripts()
                await self.budgets.load_scripts()
                break
            except StoreError as exc:
                if asyncio.get_running_loop().time() > deadline:
                    raise
                log.warning("waiting for redis", url=self.config.redis_url, error=str(exc))
                await asyncio.sleep(1.0)
        admin_key = bootstrap_admin_key(self.config)
        if admin_key:
            key = await self.registry.ensure_admin_key(admin_key)
            log.info("admin key ready", key_id=key.key_id, display_prefix=key.display_prefix)

    async def join(self) -> None:
        """Count this process as a gateway replica sharing the limits (the fail-open
        share divides by the live count) and start writing usage records; ``aclose``
        leaves. Not for the admin service."""
        with contextlib.suppress(StoreError, TimeoutError):
            await self.membership.refresh()  # the count right away, when Redis answers
        self.membership.start()
        self.usage.start()

    async def aclose(self) -> None:
        """Leave the replica set, close the Redis pool."""
        await self.membership.leave()
        await self.registry.auth.close()
        await self.usage.close()  # writes what is queued
        await self.limiter.close()
