"""A Redis Cluster primary killed under load: its replica is promoted, the limiter
follows its fail mode during the gap and uses the cluster again without a restart.

Load: 8 coroutines reserve -> settle on one hot tenant as fast as they can; the
primary serving the tenant's slot is SIGKILLed mid-load. Measured: how many
admissions beyond the policy the whole run made (``excess_over_policy`` on the
admission times), how many calls failed or were answered locally during the gap.
Checked after recovery: reservations taken before the crash (another tenant on the
same shard) still hold their leases and exactly their tokens, and settle exactly.

The cluster runs the stack's ACL (``common.redis_acl``): the limiter connects as
the service user (its password from a file, as deployed), the replicas sync as the
replication user, and no node refused any command of either (its ACL log is empty).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from bench.loadlib.hammer import excess_over_policy
from common.redis_cluster import RedisClusterServers
from ratelimit.config import LimitPolicy, RateLimitConfig, Tenant
from ratelimit.errors import LimiterUnavailableError, StoreError
from ratelimit.factory import RateLimitStack
from ratelimit.limiter.decision import Reservation
from ratelimit.limiter.storage.redis import bucket_keys
from ratelimit.tenancy.records import KeyRole, hash_key
from tests.integration.ratelimit.conftest import acl_cluster, acl_denials

pytestmark = pytest.mark.integration

HOT = LimitPolicy(
    requests_per_minute=1200, request_burst=10, tokens_per_minute=30_000, token_burst=300
)
NUM_TOKENS = 15
NUM_LOOKUPS = 32  # concurrent key lookups: connections closed under more calls
# another tenant's reservations held across the crash: tokens refill 1/min, so the
# levels read after recovery are what the reservations left
HELD = LimitPolicy(tokens_per_minute=1, token_burst=1000, max_concurrent=10)


@dataclass
class Run:
    """What the load saw (times in client monotonic ms)."""

    admitted_ms: list[float] = field(default_factory=list)
    sources: dict[str, int] = field(default_factory=dict)
    unavailable: int = 0
    denied: int = 0
    killed_ms: float = 0.0
    last_fallback_ms: float = 0.0  # the last decision not made by Redis
    decided: asyncio.Event = field(default_factory=asyncio.Event)

    def count(self, source: str) -> None:
        if source != "redis":
            self.last_fallback_ms = time.monotonic() * 1000
        if source != "unavailable":
            self.sources[source] = self.sources.get(source, 0) + 1
        self.decided.set()

    async def until(self, done: Callable[[], bool]) -> None:
        """Wait (30 s at most: a failure, not a hang) until ``done()`` after a decision."""
        async with asyncio.timeout(30):
            while not done():
                self.decided.clear()
                await self.decided.wait()


@pytest.fixture
def cluster() -> Iterator[RedisClusterServers]:
    """A cluster of its own, with the ACL: the test kills one of its primaries."""
    with contextlib.closing(acl_cluster(node_timeout_ms=1000)) as c:
        yield c


@pytest.fixture
def password_file(cluster: RedisClusterServers, tmp_path: Path) -> Path:
    path = tmp_path / "redis.password"
    path.write_text(cluster.password + "\n")
    return path


def same_shard_tenant(cluster: RedisClusterServers, prefix: str, hot: str) -> str:
    """A tenant id whose keys live on the same primary as ``hot``'s."""
    owner = cluster.primary_of(bucket_keys(prefix, hot)[0])
    return next(
        t
        for t in (f"held-{i}" for i in range(1000))
        if cluster.primary_of(bucket_keys(prefix, t)[0]) == owner
    )


async def hammer(stack: RateLimitStack, tenant: Tenant, run: Run, stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            d = await stack.limiter.reserve(tenant, NUM_TOKENS)
        except LimiterUnavailableError:
            run.unavailable += 1
            run.count("unavailable")
            await asyncio.sleep(0.005)
            continue
        run.count(d.source)
        if d.reservation is None:
            run.denied += 1
            await asyncio.sleep(0.001)
            continue
        run.admitted_ms.append(time.monotonic() * 1000)
        await stack.limiter.settle(d.reservation, prompt_tokens=NUM_TOKENS, completion_tokens=0)


def service_config(
    cluster: RedisClusterServers, password_file: Path, prefix: str, **settings: Any
) -> RateLimitConfig:
    """The limits on ``cluster`` as the service user, its password from a file (as deployed)."""
    return RateLimitConfig(
        redis_url=cluster.url,
        redis_cluster=True,
        redis_username=cluster.username,
        redis_password_file=str(password_file),
        key_prefix=prefix,
        **settings,
    )


async def failover_under_load(
    cluster: RedisClusterServers, prefix: str, fail_mode: str, password_file: Path
) -> tuple[Run, RateLimitStack, list[Reservation], Tenant]:
    config = service_config(
        cluster,
        password_file,
        prefix,
        fail_mode=fail_mode,
        timeout_ms=200,
        breaker_failures=3,
        breaker_open_ms=300,
    )
    stack = RateLimitStack.from_config(config)
    await stack.start(wait_s=10)
    await stack.join()  # one live replica: the fail-open share is the whole policy
    hot = Tenant("hot", HOT)
    held_tenant = Tenant(same_shard_tenant(cluster, prefix, "hot"), HELD)
    held = []
    for _ in range(5):
        d = await stack.limiter.reserve(held_tenant, 100)
        assert d.reservation is not None
        assert d.source == "redis"
        held.append(d.reservation)
    await asyncio.to_thread(cluster.wait_replicated)

    run, stop = Run(), asyncio.Event()
    load = [asyncio.create_task(hammer(stack, hot, run, stop)) for _ in range(8)]
    await run.until(lambda: len(run.admitted_ms) >= 2 * HOT.request_capacity)  # on Redis
    run.killed_ms = time.monotonic() * 1000
    dead = await asyncio.to_thread(cluster.kill_primary_of, bucket_keys(prefix, "hot")[0])
    await asyncio.to_thread(cluster.wait_promoted, bucket_keys(prefix, "hot")[0], dead)
    # the limiter finds the promoted replica by itself: decisions come from Redis again
    before = run.sources.get("redis", 0)
    await run.until(lambda: run.sources.get("redis", 0) >= before + 50)
    stop.set()
    await asyncio.gather(*load)
    return run, stack, held, held_tenant


async def check_held_reservations(
    stack: RateLimitStack, held: list[Reservation], tenant: Tenant, cluster: RedisClusterServers
) -> None:
    """The leases and tokens of reservations taken before the crash are all there (the
    promoted replica had them), and settling them gives back exactly the unused tokens;
    no node refused a command of the service or of a syncing replica."""
    usage = await stack.limiter.usage(tenant)
    assert usage.concurrent_in_use == len(held)
    assert 1000 - 100 * len(held) <= usage.tokens_available < 1000 - 100 * len(held) + 1
    for r in held:
        assert await stack.store.heartbeat(r.tenant_id, r.lease_id)
        await stack.limiter.settle(r, prompt_tokens=10, completion_tokens=0)
    usage = await stack.limiter.usage(tenant)
    assert usage.concurrent_in_use == 0
    assert 1000 - 10 * len(held) <= usage.tokens_available < 1000 - 10 * len(held) + 1
    assert usage.prompt_tokens_total == 10 * len(held)
    assert acl_denials(cluster) == []


def report(fail_mode: str, run: Run) -> float:
    excess = excess_over_policy(sorted(run.admitted_ms), HOT, NUM_TOKENS)
    print(
        f"\nfailover, fail_mode={fail_mode}: admitted {len(run.admitted_ms)}, "
        f"denied {run.denied}, unavailable {run.unavailable}, by source {run.sources}, "
        f"gap {run.last_fallback_ms - run.killed_ms:.0f} ms, "
        f"most admissions beyond the policy in any interval {excess:.1f}"
    )
    return excess


async def test_fail_open_through_a_failover(
    cluster: RedisClusterServers, prefix: str, password_file: Path
) -> None:
    run, stack, held, held_tenant = await failover_under_load(
        cluster, prefix, "open", password_file
    )
    try:
        excess = report("open", run)
        assert run.unavailable == 0
        assert run.sources.get("local", 0) > 0  # the gap was served from the local share
        # the local share starts with a full bucket, and the Redis bucket refills to its
        # burst during the gap: two bursts over the policy at most (one gap: no flapping
        # back and forth), plus a request or two in flight
        assert excess <= 2 * HOT.request_capacity + 2
        await check_held_reservations(stack, held, held_tenant, cluster)
    finally:
        await stack.aclose()


async def test_fail_closed_through_a_failover(
    cluster: RedisClusterServers, prefix: str, password_file: Path
) -> None:
    run, stack, held, held_tenant = await failover_under_load(
        cluster, prefix, "closed", password_file
    )
    try:
        excess = report("closed", run)
        assert run.unavailable > 0  # the gap was refused
        assert run.sources.get("local", 0) == 0
        assert excess <= 1
        await check_held_reservations(stack, held, held_tenant, cluster)
    finally:
        await stack.aclose()


async def test_key_lookups_through_a_failover_fail_only_as_store_errors(
    cluster: RedisClusterServers, prefix: str, password_file: Path
) -> None:
    """Key-cache misses (TTL 0) from 32 coroutines while the primary holding a key record
    is killed: each lookup answers or raises ``StoreError`` (the gateway's UNAVAILABLE),
    whatever redis-py raised under it; lookups answer again after the promotion."""
    stack = RateLimitStack.from_config(
        service_config(cluster, password_file, prefix, auth_cache_ttl_ms=0)
    )
    await stack.start(wait_s=10)
    try:
        keys = []
        for i in range(12):
            await stack.registry.upsert_tenant(Tenant(f"team-{i}", LimitPolicy()))
            keys.append((await stack.registry.create_key(f"team-{i}", "k", KeyRole.TENANT))[0])
        records = [f"{prefix}key:{hash_key(k)}" for k in keys]
        await asyncio.to_thread(cluster.wait_replicated)
        outcomes: Counter[str] = Counter()
        stop, answered = asyncio.Event(), asyncio.Event()

        async def look_up(i: int) -> None:
            while not stop.is_set():
                try:
                    await stack.registry.authenticate(keys[(i + outcomes.total()) % len(keys)])
                    outcomes["ok"] += 1
                    answered.set()
                except StoreError as exc:  # anything else fails the test
                    cause = type(exc.__cause__).__name__
                    outcomes[f"StoreError from {cause}"] += 1
                    await asyncio.sleep(0.005)

        tasks = [asyncio.create_task(look_up(i)) for i in range(NUM_LOOKUPS)]
        dead = await asyncio.to_thread(cluster.kill_primary_of, records[0])
        await asyncio.to_thread(cluster.wait_promoted, records[0], dead)
        ok_before = outcomes["ok"]
        async with asyncio.timeout(30):
            while outcomes["ok"] < ok_before + 200:
                answered.clear()
                await answered.wait()
        stop.set()
        await asyncio.gather(*tasks)  # re-raises any error that was not a StoreError
        print(f"\nkey lookups through a failover: {dict(outcomes)}")
        assert sum(n for o, n in outcomes.items() if o != "ok") > 0  # the gap was seen
        assert acl_denials(cluster) == []
    finally:
        await stack.aclose()
