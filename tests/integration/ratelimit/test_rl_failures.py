"""Crashes: a killed gateway's leases expire; Redis dies, stalls and comes back."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import pytest
from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from common.config import ROOT
from common.redis_server import RedisServer
from ratelimit.config import Dimension, LimitPolicy, Tenant
from ratelimit.errors import LimiterUnavailableError
from ratelimit.limiter.membership import ReplicaMembership
from ratelimit.limiter.rate_limiter import RateLimiter
from ratelimit.limiter.storage.redis import SCRIPTS, RedisStore
from ratelimit.redis_scripts import LuaScript
from ratelimit.store_guard import store_breaker

pytestmark = pytest.mark.integration

TENANT = Tenant("acme", LimitPolicy(requests_per_minute=6000, max_concurrent=2))

HOLDER = """
import asyncio, sys
from redis.asyncio import Redis
from ratelimit.config import LimitPolicy
from ratelimit.limiter.storage.redis import RedisStore

async def main() -> None:
    store = RedisStore(Redis.from_url(sys.argv[1], decode_responses=True),
                       prefix=sys.argv[2], lease_ttl_ms=int(sys.argv[3]))
    policy = LimitPolicy(requests_per_minute=6000, max_concurrent=2)
    for lease in ("x", "y"):
        outcome = await store.reserve("acme", policy, num_tokens=0, lease_id=lease, shadow=False)
        assert outcome.taken, outcome
    print("holding", flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


def client_for(url: str) -> Redis:
    return Redis.from_url(
        url,
        decode_responses=True,
        socket_timeout=2,
        socket_connect_timeout=2,
        retry=Retry(NoBackoff(), 1),
    )


async def wait_until(predicate: Callable[[], Awaitable[bool]], limit_s: float = 20.0) -> None:
    """Poll until ``predicate()`` is true; fail after a generous ``limit_s``."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if await predicate():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"condition not met within {limit_s}s")


def hold_leases_then_die(url: str, prefix: str, lease_ttl_ms: int) -> None:
    """A client process takes both leases of 'acme' and is SIGKILLed (no cleanup)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, url, prefix, str(lease_ttl_ms)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == b"holding"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()


async def test_leases_of_a_killed_client_expire(
    redis_client: Redis, redis_server: RedisServer, prefix: str
) -> None:
    hold_leases_then_die(redis_server.url, prefix, 600)
    store = RedisStore(redis_client, prefix=prefix, lease_ttl_ms=600)
    denied = await store.reserve("acme", TENANT.limits, num_tokens=0, lease_id="a", shadow=False)
    assert denied.denied == Dimension.CONCURRENCY
    assert 0 < denied.retry_after_ms <= 600

    async def admitted() -> bool:
        o = await store.reserve("acme", TENANT.limits, num_tokens=0, lease_id="a", shadow=False)
        return o.taken

    await wait_until(admitted)


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    """A server of this test's own, which it may kill and restart."""
    server = RedisServer().start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
async def limiter_factory(
    own_redis: RedisServer,
) -> AsyncIterator[Callable[[str], RateLimiter]]:
    made: list[RateLimiter] = []

    def make(fail_mode: str) -> RateLimiter:
        store = RedisStore(client_for(own_redis.url), prefix="f:")
        limiter = RateLimiter(
            store,
            fail_mode=fail_mode,
            timeout_ms=200,
            num_replicas=2,
            breaker=store_breaker(2, 300),
        )
        made.append(limiter)
        return limiter

    yield make
    for limiter in made:
        await limiter.close()


def reloads() -> int:
    return sum(s.num_reloads for s in SCRIPTS if isinstance(s, LuaScript))


async def test_redis_killed_fails_open_then_recovers(
    own_redis: RedisServer, limiter_factory: Callable[[str], RateLimiter]
) -> None:
    limiter: RateLimiter = limiter_factory("open")
    assert (await limiter.reserve(TENANT, 1)).source == "redis"
    own_redis.kill()
    decisions = [await limiter.reserve(TENANT, 1) for _ in range(4)]
    assert [d.source for d in decisions] == ["local"] * 4
    assert [d.allowed for d in decisions] == [True, False, False, False]  # 2 leases / 2 replicas
    assert decisions[0].policy == TENANT.limits.divided(2)
    before = reloads()
    own_redis.start()

    async def shared_again() -> bool:
        return (await limiter.reserve(TENANT, 1)).source == "redis"

    await wait_until(shared_again)
    assert reloads() > before  # the restarted server had no scripts: NOSCRIPT -> reload


async def test_fail_open_share_follows_the_live_replica_count(
    own_redis: RedisServer, limiter_factory: Callable[[str], RateLimiter]
) -> None:
    """The fail-open divisor is the live number of gateways (configured: 2), counted in
    Redis: joins, a clean leave, and a replica that went silent past its TTL."""
    limiter: RateLimiter = limiter_factory("open")
    clients = [client_for(own_redis.url) for _ in range(4)]
    members = [
        ReplicaMembership(c, prefix="f:", ttl_ms=60_000, on_count=limiter.set_live_replicas)
        for c in clients[:3]
    ]
    silent = ReplicaMembership(clients[3], prefix="f:", ttl_ms=300, on_count=lambda n: None)
    try:
        for m in members:
            await m.refresh()
        assert await silent.refresh() == 4
        assert await members[0].refresh() == 4
        assert limiter.num_replicas == 4
        await members[2].leave()  # a clean shutdown

        async def silent_one_gone() -> bool:
            return await members[0].refresh() == 2  # the short-TTL entry expired

        await wait_until(silent_one_gone)
        assert limiter.num_replicas == 2
        assert len({m.id for m in (*members, silent)}) == 4
        await members[1].leave()
        assert await members[0].refresh() == 1
        own_redis.kill()
        decision = await limiter.reserve(TENANT, 1)
        assert decision.source == "local"
        assert decision.policy == TENANT.limits  # the whole policy: one live replica
    finally:
        for c in clients:
            await c.aclose()


async def test_redis_killed_fails_closed_then_recovers(
    own_redis: RedisServer, limiter_factory: Callable[[str], RateLimiter]
) -> None:
    limiter: RateLimiter = limiter_factory("closed")
    assert (await limiter.reserve(TENANT, 1)).allowed
    own_redis.kill()
    for _ in range(3):
        with pytest.raises(LimiterUnavailableError, match="fails closed"):
            await limiter.reserve(TENANT, 1)
    own_redis.start()

    async def serving() -> bool:
        try:
            return (await limiter.reserve(TENANT, 1)).allowed
        except LimiterUnavailableError:
            return False

    await wait_until(serving)


async def test_stalled_redis_costs_the_budget_not_the_stall(
    own_redis: RedisServer, limiter_factory: Callable[[str], RateLimiter]
) -> None:
    limiter: RateLimiter = limiter_factory("open")
    assert (await limiter.reserve(TENANT, 1)).source == "redis"
    admin = client_for(own_redis.url)
    try:
        await admin.client_pause(1000)
        d = await limiter.reserve(TENANT, 1)
        assert d.source == "local"  # timed out after 200 ms, not 1 s
        assert d.allowed
        assert limiter.breaker.consecutive_failures == 1
    finally:
        await admin.aclose()

    async def shared_again() -> bool:
        return (await limiter.reserve(TENANT, 1)).source == "redis"

    await wait_until(shared_again)
