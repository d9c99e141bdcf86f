"""The Store contract, parametrized over MemoryStore and RedisStore (injected clock)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

from ratelimit.config import Dimension, LimitPolicy
from ratelimit.limiter.storage import Store
from ratelimit.limiter.storage.memory import MemoryStore
from ratelimit.limiter.storage.redis import RedisStore, bucket_keys
from tests.support.clock import FakeClock

pytestmark = pytest.mark.integration

POLICY = LimitPolicy(
    requests_per_minute=120, tokens_per_minute=6000, max_concurrent=2, request_burst=3
)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(1_700_000_000_000.0)


@pytest.fixture(params=["memory", "redis"])
async def store(
    request: pytest.FixtureRequest, clock: FakeClock, redis_client: Redis, prefix: str
) -> AsyncIterator[Store]:
    if request.param == "memory":
        yield MemoryStore(lease_ttl_ms=1000, concurrency_retry_ms=700, clock=clock)
    else:
        yield RedisStore(
            redis_client, prefix=prefix, lease_ttl_ms=1000, concurrency_retry_ms=700, clock=clock
        )


async def test_all_or_nothing_and_retry_after(store: Store, clock: FakeClock) -> None:
    o = await store.reserve("t", POLICY, num_tokens=5000, lease_id="a", shadow=False)
    assert o.taken
    assert (o.requests_left, o.tokens_left, o.num_leases) == (2.0, 1000.0, 1)
    o = await store.reserve("t", POLICY, num_tokens=2000, lease_id="b", shadow=False)
    assert not o.allowed
    assert o.denied == Dimension.TOKENS
    assert o.retry_after_ms == 10_000  # 1000 tokens at 100/s
    u = await store.usage("t", POLICY)
    assert (u.requests_available, u.tokens_available, u.concurrent_in_use) == (2.0, 1000.0, 1)
    assert u.requests_denied_total == 1
    clock.advance(10_000)
    o = await store.reserve("t", POLICY, num_tokens=2000, lease_id="b", shadow=False)
    assert o.taken


async def test_leases_expire_and_heartbeat_extends(store: Store, clock: FakeClock) -> None:
    for lease in ("a", "b"):
        assert (await store.reserve("t", POLICY, num_tokens=1, lease_id=lease, shadow=False)).taken
    o = await store.reserve("t", POLICY, num_tokens=1, lease_id="c", shadow=False)
    assert o.denied == Dimension.CONCURRENCY
    assert o.retry_after_ms == 700  # min(hint, time until the first lease expires)
    clock.advance(600)
    assert await store.heartbeat("t", "a")
    o = await store.reserve("t", POLICY, num_tokens=1, lease_id="c", shadow=False)
    assert o.retry_after_ms == 400
    clock.advance(400)  # "b" expired, "a" was extended to +1600
    assert not await store.heartbeat("t", "b")
    o = await store.reserve("t", POLICY, num_tokens=1, lease_id="c", shadow=False)
    assert o.taken
    assert o.num_leases == 2


async def test_settle_refunds_up_to_capacity_and_counts(store: Store, clock: FakeClock) -> None:
    o = await store.reserve("t", POLICY, num_tokens=4000, lease_id="a", shadow=False)
    assert o.tokens_left == 2000
    held = await store.settle(
        "t", POLICY, lease_id="a", refund_tokens=3000, prompt_tokens=600, completion_tokens=400
    )
    assert held
    u = await store.usage("t", POLICY)
    assert u.tokens_available == 5000
    assert u.concurrent_in_use == 0
    assert (u.prompt_tokens_total, u.completion_tokens_total, u.requests_total) == (600, 400, 1)
    clock.advance(60_000)
    await store.settle(
        "t", POLICY, lease_id="a", refund_tokens=9999, prompt_tokens=0, completion_tokens=0
    )
    assert (await store.usage("t", POLICY)).tokens_available == 6000


async def test_reset_refills_and_keeps_leases(store: Store) -> None:
    for i in range(2):
        await store.reserve("t", POLICY, num_tokens=3000, lease_id=f"l{i}", shadow=False)
    await store.reset("t")
    u = await store.usage("t", POLICY)
    assert (u.requests_available, u.tokens_available, u.concurrent_in_use) == (3.0, 6000.0, 2)
    await store.forget("t")
    u = await store.usage("t", POLICY)
    assert (u.concurrent_in_use, u.requests_total) == (0, 0)


async def test_shadow_mode_takes_nothing(store: Store) -> None:
    policy = LimitPolicy(requests_per_minute=1)
    assert (await store.reserve("t", policy, num_tokens=0, lease_id="a", shadow=True)).taken
    o = await store.reserve("t", policy, num_tokens=0, lease_id="b", shadow=True)
    assert o.allowed
    assert o.shadow_denied
    u = await store.usage("t", policy)
    assert (u.requests_total, u.shadow_denials_total, u.concurrent_in_use) == (2, 1, 1)


async def test_policy_change_from_unlimited_starts_full(store: Store) -> None:
    await store.reserve("t", LimitPolicy(), num_tokens=100, lease_id="a", shadow=False)
    o = await store.reserve("t", POLICY, num_tokens=100, lease_id="b", shadow=False)
    assert o.tokens_left == 5900


async def test_redis_keys_are_hash_tagged_and_expire(redis_client: Redis, prefix: str) -> None:
    store = RedisStore(redis_client, prefix=prefix, lease_ttl_ms=1000)
    await store.reserve("acme", POLICY, num_tokens=10, lease_id="a", shadow=False)
    await store.take("acme", POLICY, num_tokens=20, lease_id="a", shadow=False)
    bucket, leases, usage, takes = bucket_keys(prefix, "acme")
    assert bucket == f"{prefix}{{acme}}:b"
    assert all("{acme}" in k for k in (leases, usage, takes))
    assert 0 < await redis_client.pttl(bucket) <= 31_000  # time until full + 1 s
    assert 0 < await redis_client.pttl(leases) <= 2000
    assert 0 < await redis_client.pttl(takes) <= 2000
    assert await redis_client.pttl(usage) == -1  # totals are kept


async def test_noscript_is_reloaded(redis_client: Redis, prefix: str) -> None:
    store = RedisStore(redis_client, prefix=prefix)
    await store.load_scripts()
    await redis_client.script_flush()
    o = await store.reserve("t", POLICY, num_tokens=1, lease_id="a", shadow=False)
    assert o.taken


async def test_settle_only_if_held_refunds_exactly_once(store: Store) -> None:
    """The compensation of a reserve whose answer was lost: refund iff its lease exists."""
    o = await store.reserve("t", POLICY, num_tokens=2500, lease_id="lost", shadow=False)
    assert o.taken

    async def compensate(lease_id: str) -> bool:
        return await store.settle(
            "t",
            POLICY,
            lease_id=lease_id,
            refund_tokens=2500,
            prompt_tokens=0,
            completion_tokens=0,
            only_if_held=True,
        )

    assert await compensate("never-ran") is False
    assert (await store.usage("t", POLICY)).tokens_available == 3500  # nothing given back
    assert await compensate("lost") is True
    assert await compensate("lost") is False  # once only
    u = await store.usage("t", POLICY)
    assert (u.tokens_available, u.concurrent_in_use) == (6000.0, 0)


async def test_an_overrun_to_exactly_minus_one_is_not_unlimited(
    store: Store, clock: FakeClock
) -> None:
    """A level driven to -1 by an overrun (settled usage above the reservation) stays a
    debt; it is not read back as the "unlimited" a dimension without a limit reports."""
    policy = LimitPolicy(tokens_per_minute=6000)
    o = await store.reserve("t", policy, num_tokens=6000, lease_id="a", shadow=False)
    assert o.taken
    assert o.tokens_left == 0.0
    await store.settle(
        "t", policy, lease_id="a", refund_tokens=-1, prompt_tokens=6000, completion_tokens=1
    )  # used one token more than reserved
    u = await store.usage("t", policy)
    assert u.tokens_available == 0.0  # reported never below 0, never as -1 (unlimited)
    assert u.requests_available == -1.0  # the dimension without a limit
    o = await store.reserve("t", policy, num_tokens=1, lease_id="b", shadow=False)
    assert not o.allowed
    assert o.denied == Dimension.TOKENS
    assert o.retry_after_ms == 20  # the debt of 1 and the token asked for, at 100/s


async def test_a_clock_stepping_back_credits_nothing(store: Store, clock: FakeClock) -> None:
    """Back 30 s then forward again: no refill for the interval seen twice."""
    policy = LimitPolicy(tokens_per_minute=6000)
    assert (await store.reserve("t", policy, num_tokens=6000, lease_id="a", shadow=False)).taken
    start = clock.now
    clock.now = start - 30_000
    assert not (await store.reserve("t", policy, num_tokens=1, lease_id="b", shadow=False)).taken
    await store.settle(
        "t", policy, lease_id="a", refund_tokens=3000, prompt_tokens=0, completion_tokens=0
    )  # a write while the clock is behind
    clock.now = start + 1000  # one real second after the take
    u = await store.usage("t", policy)
    assert u.tokens_available == pytest.approx(3100.0)  # the refund + 1 s at 100/s, not 31 s


async def test_take_after_reserve_then_settle_is_exact(store: Store, clock: FakeClock) -> None:
    """The gateway's two steps: 1 request + lease before tokenizing, tokens after.
    Settle gives back what take took (remembered by lease), whatever the caller knew."""
    policy = LimitPolicy(requests_per_minute=60, tokens_per_minute=6000)
    o = await store.reserve("t", policy, num_tokens=0, lease_id="a", shadow=False)
    assert o.taken
    assert (o.requests_left, o.tokens_left) == (59.0, 6000.0)
    o = await store.take("t", policy, num_tokens=5000, lease_id="a", shadow=False)
    assert o.taken
    assert (o.requests_left, o.tokens_left, o.num_leases) == (59.0, 1000.0, 1)
    again = await store.take("t", policy, num_tokens=5000, lease_id="a", shadow=False)
    assert again.taken  # a retried call takes nothing twice
    assert again.tokens_left == 1000.0
    assert (await store.reserve("t", policy, num_tokens=0, lease_id="b", shadow=False)).taken
    o = await store.take("t", policy, num_tokens=2000, lease_id="b", shadow=False)
    assert not o.allowed  # tokens only: the request unit of "b" stays spent
    assert (o.denied, o.retry_after_ms) == (Dimension.TOKENS, 10_000)
    o = await store.take("t", policy, num_tokens=7000, lease_id="b", shadow=False)
    assert o.retry_after_ms == -1  # above the bucket's capacity: never
    await store.settle(
        "t", policy, lease_id="b", refund_tokens=0, prompt_tokens=0, completion_tokens=0
    )
    # "a" used 300 tokens; the caller's refund never includes the take (0 - 300 here)
    await store.settle(
        "t", policy, lease_id="a", refund_tokens=-300, prompt_tokens=100, completion_tokens=200
    )
    u = await store.usage("t", policy)
    assert (u.tokens_available, u.requests_available, u.concurrent_in_use) == (5700.0, 58.0, 0)
    assert (u.requests_total, u.prompt_tokens_total, u.completion_tokens_total) == (2, 100, 200)
    assert u.requests_denied_total == 2


async def test_take_in_shadow_mode_and_release_keeping_the_take(store: Store) -> None:
    policy = LimitPolicy(tokens_per_minute=600)
    assert (await store.reserve("t", policy, num_tokens=0, lease_id="a", shadow=True)).taken
    o = await store.take("t", policy, num_tokens=1000, lease_id="a", shadow=True)
    assert o.allowed  # shadow: admitted, counted, nothing taken
    assert o.shadow_denied
    o = await store.take("t", policy, num_tokens=100, lease_id="a", shadow=False)
    assert o.taken
    await store.settle(
        "t",
        policy,
        lease_id="a",
        refund_tokens=0,
        prompt_tokens=0,
        completion_tokens=0,
        refund_take=False,
    )  # release: stays charged
    u = await store.usage("t", policy)
    assert u.tokens_available == 500.0
    assert u.shadow_denials_total == 1
