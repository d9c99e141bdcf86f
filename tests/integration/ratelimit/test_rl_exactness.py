"""Exactness against a real Redis: Lua == Python, many processes (on one server and on
a Redis Cluster), no window-edge burst."""

from __future__ import annotations

import asyncio
import math
import uuid

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis.asyncio import Redis
from redis.exceptions import MovedError

from bench.loadlib.hammer import HammerSpec, excess_over_policy, hammer
from common.redis_cluster import RedisClusterServers
from common.redis_server import RedisServer
from ratelimit.config import LimitPolicy
from ratelimit.limiter.storage.memory import MemoryStore
from ratelimit.limiter.storage.redis import RedisStore, bucket_keys
from tests.support.clock import FakeClock

pytestmark = pytest.mark.integration


op = st.tuples(
    st.sampled_from(["reserve", "reserve", "reserve", "settle", "heartbeat"]),
    st.floats(min_value=0, max_value=3000),  # ms to advance first
    st.integers(min_value=0, max_value=400),  # tokens (reserve) / tokens used (settle)
)
policies = st.builds(
    LimitPolicy,
    requests_per_minute=st.sampled_from([0, 1, 7, 60, 1000]),
    tokens_per_minute=st.sampled_from([0, 100, 999, 6000]),
    max_concurrent=st.sampled_from([0, 1, 3]),
)


async def _compare(
    url: str, prefix: str, policy: LimitPolicy, ops: list[tuple[str, float, int]]
) -> None:
    clock = FakeClock(1_700_000_000_123.25)
    client = Redis.from_url(url, decode_responses=True)
    try:
        redis_store = RedisStore(client, prefix=prefix, lease_ttl_ms=2000, clock=clock)
        mem = MemoryStore(lease_ttl_ms=2000, concurrency_retry_ms=1000, clock=clock)
        leases: list[tuple[str, int]] = []
        for i, (kind, advance, n) in enumerate(ops):
            clock.advance(advance)
            if kind == "reserve":
                a = await redis_store.reserve(
                    "t", policy, num_tokens=n, lease_id=f"l{i}", shadow=False
                )
                b = await mem.reserve("t", policy, num_tokens=n, lease_id=f"l{i}", shadow=False)
                assert a.allowed == b.allowed
                assert a.denied == b.denied
                assert a.retry_after_ms == b.retry_after_ms
                assert a.num_leases == b.num_leases
                assert math.isclose(a.requests_left, b.requests_left, abs_tol=1e-9)
                assert math.isclose(a.tokens_left, b.tokens_left, abs_tol=1e-9)
                if a.taken:
                    leases.append((f"l{i}", n))
            elif leases:
                lease, reserved = leases.pop(0) if kind == "settle" else leases[0]
                if kind == "settle":
                    a_held = await redis_store.settle(
                        "t",
                        policy,
                        lease_id=lease,
                        refund_tokens=reserved - n,
                        prompt_tokens=n,
                        completion_tokens=0,
                    )
                    b_held = await mem.settle(
                        "t",
                        policy,
                        lease_id=lease,
                        refund_tokens=reserved - n,
                        prompt_tokens=n,
                        completion_tokens=0,
                    )
                    assert a_held == b_held
                else:
                    assert await redis_store.heartbeat("t", lease) == await mem.heartbeat(
                        "t", lease
                    )
        assert await redis_store.usage("t", policy) == await mem.usage("t", policy)
    finally:
        await client.aclose()


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(policy=policies, ops=st.lists(op, min_size=1, max_size=40))
def test_lua_matches_the_python_algorithm(
    redis_server: RedisServer, policy: LimitPolicy, ops: list[tuple[str, float, int]]
) -> None:
    asyncio.run(_compare(redis_server.url, f"diff{uuid.uuid4().hex}:", policy, ops))


async def test_no_double_burst_at_a_minute_boundary(redis_client: Redis, prefix: str) -> None:
    clock = FakeClock(60_000 * 28_333_333 - 100.0)  # 100 ms before a minute starts
    store = RedisStore(redis_client, prefix=prefix, clock=clock)
    policy = LimitPolicy(requests_per_minute=600)  # capacity 600, 10/s
    admitted = 0
    for i in range(1300):
        if i == 650:
            clock.advance(200)  # cross the minute boundary
        o = await store.reserve("t", policy, num_tokens=0, lease_id=f"{i}", shadow=False)
        admitted += o.taken
    # a fixed window would admit 600 + 600; the bucket admits 600 + 200 ms of refill
    assert admitted == 602


HOT = LimitPolicy(
    requests_per_minute=1200, request_burst=10, tokens_per_minute=30_000, token_burst=300
)


def hammer_one_tenant(url: str, prefix: str, *, cluster: bool = False) -> list[float]:
    """4 processes x 8 coroutines on one tenant for 2.5 s; checks that the limiter
    admitted no more than ``HOT`` allows (+1) in any interval and returns the
    admissions' server timestamps (ms, sorted)."""
    spec = HammerSpec(
        url=url,
        prefix=prefix,
        tenant_id="hot",
        policy=HOT,
        seconds=2.5,
        num_coroutines=8,
        num_tokens=15,
        cluster=cluster,
    )
    results = hammer(spec, num_processes=4)
    times = sorted(t for r in results for t in r.allowed_at_ms)
    assert sum(r.num_errors for r in results) == 0
    assert sum(r.num_denied for r in results) > 0  # they really competed
    assert len(times) == sum(r.num_allowed for r in results)
    assert len(times) >= HOT.request_capacity
    # requests: 20/s after a burst of 10; tokens: 500/s after 300 (= 33 req/s, 20 requests)
    assert excess_over_policy(times, HOT, spec.num_tokens) <= 1
    return times


def test_four_processes_admit_no_more_than_the_policy(
    redis_server: RedisServer, prefix: str
) -> None:
    hammer_one_tenant(redis_server.url, prefix)


def test_four_processes_on_a_redis_cluster_admit_no_more_than_the_policy(
    redis_cluster: RedisClusterServers, prefix: str
) -> None:
    """The same hammer through redis-py's cluster client: the bucket lives on the primary
    of its slot, and the other primaries send callers there."""
    hammer_one_tenant(redis_cluster.service_url, prefix, cluster=True)  # as the ACL user
    bucket = bucket_keys(prefix, "hot")[0]
    owner = redis_cluster.primary_of(bucket)
    for i in range(redis_cluster.num_primaries):
        with redis_cluster.client(i) as node:
            if i == owner:
                assert node.exists(bucket) == 1
            else:
                with pytest.raises(MovedError):
                    node.exists(bucket)
