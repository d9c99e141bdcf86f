"""The limiter's state in Redis: one Lua call per decision, shared by every replica.

Every operation is one script over one tenant's hash-tagged keys (see
``ratelimit.limiter.lua``), so it is atomic across gateway replicas and works on
Redis Cluster. Redis errors and timeouts surface as ``StoreError``; the
limiter decides what a failure means (fail open or closed).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ratelimit.config import Dimension, LimitPolicy
from ratelimit.limiter.algorithm import Outcome
from ratelimit.limiter.lua import (
    HEARTBEAT,
    RESERVE,
    SETTLE,
    TAKE,
    USAGE,
)
from ratelimit.limiter.storage import UsageSnapshot
from ratelimit.redis_client import RedisClient, store_errors
from ratelimit.redis_scripts import LuaScript, ScriptBatcher, load_scripts

_RESERVE = LuaScript("reserve", RESERVE)
_SETTLE = LuaScript("settle", SETTLE)
_HEARTBEAT = LuaScript("heartbeat", HEARTBEAT)
_USAGE = LuaScript("usage", USAGE)
_TAKE = LuaScript("take", TAKE)
SCRIPTS = (_RESERVE, _TAKE, _SETTLE, _HEARTBEAT, _USAGE)


def bucket_keys(prefix: str, tenant_id: str) -> tuple[str, str, str, str]:
    """The (bucket, leases, usage, takes) keys of a tenant, in one cluster slot."""
    base = f"{prefix}{{{tenant_id}}}"
    return f"{base}:b", f"{base}:l", f"{base}:u", f"{base}:k"


def _outcome(res: Sequence[Any]) -> Outcome:
    return Outcome(
        allowed=bool(res[0]),
        denied=Dimension(int(res[1])),
        retry_after_ms=int(res[2]),
        requests_left=float(res[3]),
        tokens_left=float(res[4]),
        num_leases=int(res[5]),
        now_ms=float(res[6]),
    )


def _policy_args(policy: LimitPolicy) -> list[int]:
    return [
        policy.requests_per_minute,
        policy.request_capacity,
        policy.tokens_per_minute,
        policy.token_capacity,
    ]


class RedisStore:
    """A ``Store`` on Redis.

    Args:
        client: A ``RedisClient`` (one server or a cluster) with ``decode_responses=True``.
        prefix: Key prefix shared with the registry (e.g. ``"rl:"``).
        lease_ttl_ms: Lifetime of a lease without heartbeat.
        concurrency_retry_ms: Upper bound of the retry hint for a full lease set.
        clock: Milliseconds to use instead of Redis ``TIME`` (tests only).
        batch_timeout_ms: Longest a batch of script calls may take (the callers' own
            budget: past it every one of them has given up); None = no bound.
    """

    name = "redis"

    def __init__(
        self,
        client: RedisClient,
        *,
        prefix: str = "rl:",
        lease_ttl_ms: int = 30_000,
        concurrency_retry_ms: int = 1000,
        clock: Callable[[], float] | None = None,
        batch_timeout_ms: int | None = None,
    ) -> None:
        self.client = client
        self.prefix = prefix
        self.lease_ttl_ms = lease_ttl_ms
        self.concurrency_retry_ms = concurrency_retry_ms
        self.clock = clock
        # admissions, settlements and heartbeats of concurrent requests share round trips
        self.scripts = ScriptBatcher(
            client, timeout_s=None if batch_timeout_ms is None else batch_timeout_ms / 1000.0
        )

    def _now(self) -> str:
        return "" if self.clock is None else repr(float(self.clock()))

    async def _run(self, script: LuaScript, keys: Sequence[str], args: Sequence[Any]) -> Any:
        with store_errors(script.name):
            return await self.scripts(script, keys, args)

    async def load_scripts(self) -> None:
        """Load every script once (start-up); raises ``StoreError`` if Redis is down."""
        await load_scripts(self.client, SCRIPTS)

    async def reserve(
        self,
        tenant_id: str,
        policy: LimitPolicy,
        *,
        num_tokens: int,
        lease_id: str,
        shadow: bool,
    ) -> Outcome:
        """See ``Store.reserve``."""
        args = [
            self._now(),
            *_policy_args(policy),
            policy.max_concurrent,
            num_tokens,
            lease_id,
            self.lease_ttl_ms,
            1 if shadow else 0,
            self.concurrency_retry_ms,
        ]
        return _outcome(await self._run(_RESERVE, bucket_keys(self.prefix, tenant_id), args))

    async def take(
        self,
        tenant_id: str,
        policy: LimitPolicy,
        *,
        num_tokens: int,
        lease_id: str,
        shadow: bool,
    ) -> Outcome:
        """See ``Store.take``."""
        args = [
            self._now(),
            *_policy_args(policy),
            num_tokens,
            lease_id,
            self.lease_ttl_ms,
            1 if shadow else 0,
        ]
        return _outcome(await self._run(_TAKE, bucket_keys(self.prefix, tenant_id), args))

    async def settle(
        self,
        tenant_id: str,
        policy: LimitPolicy,
        *,
        lease_id: str,
        refund_tokens: int,
        prompt_tokens: int,
        completion_tokens: int,
        only_if_held: bool = False,
        refund_take: bool = True,
    ) -> bool:
        """See ``Store.settle``."""
        args = [
            self._now(),
            *_policy_args(policy),
            refund_tokens,
            prompt_tokens,
            completion_tokens,
            lease_id,
            int(only_if_held),
            int(refund_take),
        ]
        return bool(await self._run(_SETTLE, bucket_keys(self.prefix, tenant_id), args))

    async def heartbeat(self, tenant_id: str, lease_id: str) -> bool:
        """See ``Store.heartbeat``."""
        keys = bucket_keys(self.prefix, tenant_id)[1::2]  # leases, takes
        return bool(await self._run(_HEARTBEAT, keys, [self._now(), lease_id, self.lease_ttl_ms]))

    async def usage(self, tenant_id: str, policy: LimitPolicy) -> UsageSnapshot:
        """See ``Store.usage``."""
        args = [self._now(), *_policy_args(policy)]
        res = await self._run(_USAGE, bucket_keys(self.prefix, tenant_id), args)
        return UsageSnapshot(
            requests_available=float(res[0]),
            tokens_available=float(res[1]),
            concurrent_in_use=int(res[2]),
            requests_total=int(res[3]),
            prompt_tokens_total=int(res[4]),
            completion_tokens_total=int(res[5]),
            requests_denied_total=int(res[6]),
            shadow_denials_total=int(res[7]),
        )

    async def reset(self, tenant_id: str) -> None:
        """See ``Store.reset``."""
        await self._delete(bucket_keys(self.prefix, tenant_id)[:1])

    async def forget(self, tenant_id: str) -> None:
        """See ``Store.forget``."""
        await self._delete(bucket_keys(self.prefix, tenant_id))

    async def _delete(self, keys: Sequence[str]) -> None:
        with store_errors("delete"):
            await self.client.delete(*keys)

    async def close(self) -> None:
        """Close the client's connection pool."""
        await self.client.aclose()
