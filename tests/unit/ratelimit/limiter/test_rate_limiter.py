"""RateLimiter over a MemoryStore with a fake clock, and over a failing store."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from common.breaker import BreakerState, CircuitBreaker
from ratelimit.config import Dimension, LimitPolicy, Tenant
from ratelimit.errors import LimiterUnavailableError, StoreError
from ratelimit.limiter.algorithm import Outcome
from ratelimit.limiter.rate_limiter import RateLimiter
from ratelimit.limiter.storage import UsageSnapshot
from ratelimit.limiter.storage.memory import MemoryStore
from ratelimit.store_guard import store_breaker
from tests.support.clock import FakeClock


class BrokenStore:
    """A store that fails (or hangs) on demand, delegating to a MemoryStore otherwise."""

    name = "redis"

    def __init__(self, inner: MemoryStore) -> None:
        self.inner = inner
        self.lease_ttl_ms = inner.lease_ttl_ms
        self.mode = "ok"  # ok | error | hang
        self.num_calls = 0
        self.num_heartbeats = 0
        self.heartbeated = asyncio.Event()

    async def _gate(self) -> None:
        self.num_calls += 1
        if self.mode == "error":
            raise StoreError("connection refused")
        if self.mode == "hang":
            await asyncio.sleep(3600)

    async def reserve(self, *args: Any, **kwargs: Any) -> Outcome:
        await self._gate()
        return await self.inner.reserve(*args, **kwargs)

    async def take(self, *args: Any, **kwargs: Any) -> Outcome:
        await self._gate()
        return await self.inner.take(*args, **kwargs)

    async def settle(self, *args: Any, **kwargs: Any) -> bool:
        await self._gate()
        return await self.inner.settle(*args, **kwargs)

    async def heartbeat(self, *args: Any, **kwargs: Any) -> bool:
        await self._gate()
        self.num_heartbeats += 1
        if self.num_heartbeats >= 2:
            self.heartbeated.set()
        return await self.inner.heartbeat(*args, **kwargs)

    async def usage(self, *args: Any, **kwargs: Any) -> UsageSnapshot:
        await self._gate()
        return await self.inner.usage(*args, **kwargs)

    async def reset(self, tenant_id: str) -> None:
        await self._gate()

    async def forget(self, tenant_id: str) -> None:
        await self._gate()

    async def close(self) -> None:
        pass


def state_of(breaker: CircuitBreaker) -> BreakerState:
    return breaker.state


def memory(clock: FakeClock, ttl: int = 30_000) -> MemoryStore:
    return MemoryStore(lease_ttl_ms=ttl, concurrency_retry_ms=500, clock=clock)


TENANT = Tenant(
    "acme", LimitPolicy(requests_per_minute=600, tokens_per_minute=6000, max_concurrent=2)
)


async def test_reserve_settle_refunds_unused_tokens() -> None:
    clock = FakeClock(1_000_000.0)
    limiter = RateLimiter(memory(clock))
    d = await limiter.reserve(TENANT, 1000)
    assert d.allowed
    assert d.reservation is not None
    assert d.lease_id is not None
    assert d.tokens_remaining == 5000
    await limiter.settle(d.reservation, prompt_tokens=100, completion_tokens=50)
    await limiter.settle(d.reservation, prompt_tokens=100, completion_tokens=50)  # no-op
    usage = await limiter.usage(TENANT)
    assert usage.tokens_available == 5850
    assert usage.concurrent_in_use == 0
    assert (usage.prompt_tokens_total, usage.completion_tokens_total) == (100, 50)


async def test_reserve_then_take_then_settle_charges_exactly_the_usage() -> None:
    limiter = RateLimiter(memory(FakeClock(1_000_000.0)))
    d = await limiter.reserve(TENANT, 0)  # before tokenizing: a request and a lease
    assert d.reservation is not None
    t = await limiter.take(TENANT, d.reservation, 1000)
    assert t.allowed
    assert t.reservation is d.reservation
    assert t.tokens_remaining == 5000
    denied = await limiter.take(
        TENANT, (await limiter.reserve(TENANT, 0)).reservation or d.reservation, 5500
    )
    assert not denied.allowed
    assert denied.reservation is None
    assert denied.denied == Dimension.TOKENS
    assert "tokens_per_minute" in denied.message()
    await limiter.settle(d.reservation, prompt_tokens=100, completion_tokens=50)
    usage = await limiter.usage(TENANT)
    assert usage.tokens_available == 5850  # 1000 taken, 850 back
    assert usage.concurrent_in_use == 1  # the denied one's lease: its caller settles it


async def test_a_tenant_without_a_token_limit_costs_no_store_call_to_take() -> None:
    store = BrokenStore(memory(FakeClock(1_000_000.0)))
    limiter = RateLimiter(store)
    tenant = Tenant("free", LimitPolicy(requests_per_minute=600, max_concurrent=2))
    d = await limiter.reserve(tenant, 0)
    assert d.reservation is not None
    calls = store.num_calls
    t = await limiter.take(tenant, d.reservation, 10_000)
    assert t.allowed
    assert store.num_calls == calls  # one Redis round trip per request, not two
    await limiter.settle(d.reservation, prompt_tokens=5000, completion_tokens=5000)
    usage = await limiter.usage(tenant)
    assert (usage.prompt_tokens_total, usage.completion_tokens_total) == (5000, 5000)
    assert usage.concurrent_in_use == 0


async def test_a_take_the_store_failed_on_settles_exactly_either_way() -> None:
    """Fail open: a take whose answer was lost admits; settle charges the exact usage
    whether the take ran (given back by lease id) or not (charged as usage)."""
    inner = memory(FakeClock(1_000_000.0))
    store = BrokenStore(inner)
    limiter = RateLimiter(store, fail_mode="open", timeout_ms=50)
    for ran in (False, True):
        d = await limiter.reserve(TENANT, 0)
        assert d.reservation is not None
        if ran:
            await inner.take(
                "acme", TENANT.limits, num_tokens=700, lease_id=d.lease_id or "", shadow=False
            )  # the script ran, the answer was lost
        store.mode = "error"
        t = await limiter.take(TENANT, d.reservation, 700)
        assert t.allowed
        assert t.source == "local"
        store.mode = "ok"
        before = (await limiter.usage(TENANT)).tokens_available
        await limiter.settle(d.reservation, prompt_tokens=200, completion_tokens=100)
        after = (await limiter.usage(TENANT)).tokens_available
        assert after - before == (400 if ran else -300)  # net: exactly 300 charged
    closed = RateLimiter(store, fail_mode="closed", timeout_ms=50)
    d = await closed.reserve(TENANT, 0)
    assert d.reservation is not None
    store.mode = "error"
    with pytest.raises(LimiterUnavailableError):
        await closed.take(TENANT, d.reservation, 10)


async def test_release_keeps_tokens_charged_and_frees_the_slot() -> None:
    limiter = RateLimiter(memory(FakeClock(1_000_000.0)))
    d1 = await limiter.reserve(TENANT, 10)
    d2 = await limiter.reserve(TENANT, 10)
    d3 = await limiter.reserve(TENANT, 10)
    assert not d3.allowed
    assert d3.denied == Dimension.CONCURRENCY
    assert "max_concurrent" in d3.message()
    assert d1.reservation is not None
    await limiter.release(d1.reservation)
    assert (await limiter.reserve(TENANT, 10)).allowed
    usage = await limiter.usage(TENANT)
    assert usage.tokens_available == 5970
    assert d2.allowed


async def test_shadow_mode_admits_and_counts() -> None:
    tenant = Tenant("shadowy", LimitPolicy(requests_per_minute=1), shadow_mode=True)
    limiter = RateLimiter(memory(FakeClock(1_000_000.0)))
    assert (await limiter.reserve(tenant, 0)).lease_id is not None
    d = await limiter.reserve(tenant, 0)
    assert d.shadow_denied
    d = await limiter.reserve(tenant, 0)
    assert d.allowed
    assert d.shadow_denied
    assert d.denied == Dimension.REQUESTS
    assert d.reservation is not None
    assert not d.reservation.holds_lease
    await limiter.settle(d.reservation, prompt_tokens=3, completion_tokens=4)
    usage = await limiter.usage(tenant)
    assert usage.shadow_denials_total == 2
    assert usage.requests_total == 3
    assert usage.requests_denied_total == 0
    assert usage.prompt_tokens_total == 3


async def test_fail_open_uses_the_replica_share_then_recovers() -> None:
    clock = FakeClock(1_000_000.0)
    store = BrokenStore(memory(clock))
    breaker = store_breaker(2, 1000, clock_ms=clock)
    tenant = Tenant("t", LimitPolicy(requests_per_minute=8, request_burst=8))
    limiter = RateLimiter(store, num_replicas=4, breaker=breaker, fallback=memory(clock))
    store.mode = "error"
    decisions = [await limiter.reserve(tenant, 0) for _ in range(4)]
    assert [d.source for d in decisions] == ["local"] * 4
    assert [d.allowed for d in decisions] == [True, True, False, False]  # 8 / 4 replicas
    assert decisions[0].policy == LimitPolicy(requests_per_minute=2, request_burst=2)
    assert store.num_calls == 2  # the breaker opened after 2 failures
    assert state_of(breaker) == BreakerState.OPEN
    local = decisions[0].reservation
    assert local is not None
    await limiter.settle(local, prompt_tokens=0, completion_tokens=0)  # settles locally
    store.mode = "ok"
    clock.advance(1000)
    d = await limiter.reserve(tenant, 0)
    assert d.source == "redis"
    assert state_of(breaker) == BreakerState.CLOSED


async def test_fail_closed_raises_unavailable() -> None:
    store = BrokenStore(memory(FakeClock(1_000_000.0)))
    limiter = RateLimiter(store, fail_mode="closed")
    store.mode = "error"
    with pytest.raises(LimiterUnavailableError, match="fails closed"):
        await limiter.reserve(TENANT, 1)


async def test_a_store_failure_forgets_the_tenants_headroom() -> None:
    """After a failed call nothing may start before Redis answers again: no claim, no
    one-call path, in either fail mode, until an admission is seen again."""
    for mode in ("closed", "open"):
        store = BrokenStore(memory(FakeClock(1_000_000.0)))
        limiter = RateLimiter(store, fail_mode=mode)
        tenant = Tenant("h", LimitPolicy(requests_per_minute=600, max_concurrent=10))
        assert (await limiter.reserve(tenant, 1)).allowed
        assert limiter.has_headroom(tenant)
        store.mode = "error"
        if mode == "closed":
            with pytest.raises(LimiterUnavailableError):
                await limiter.reserve(tenant, 1)
        else:  # admitted by the local share, whose levels are not Redis's
            assert (await limiter.reserve(tenant, 1)).source == "local"
        assert not limiter.has_headroom(tenant)
        assert not limiter.claim_headroom(tenant, 1)
        store.mode = "ok"
        assert (await limiter.reserve(tenant, 1)).allowed
        assert limiter.claim_headroom(tenant, 1)


async def test_slow_store_costs_only_the_timeout_budget() -> None:
    store = BrokenStore(memory(FakeClock(1_000_000.0)))
    limiter = RateLimiter(store, timeout_ms=20, breaker=store_breaker(1, 60_000))
    store.mode = "hang"
    d = await limiter.reserve(TENANT, 1)
    assert d.allowed
    assert d.source == "local"
    d = await limiter.reserve(TENANT, 1)  # breaker open: the store is not called
    assert store.num_calls == 1
    assert d.source == "local"


async def test_settle_failure_is_swallowed_and_counted() -> None:
    store = BrokenStore(memory(FakeClock(1_000_000.0)))
    limiter = RateLimiter(store)
    d = await limiter.reserve(TENANT, 5)
    assert d.reservation is not None
    store.mode = "error"
    await limiter.settle(d.reservation, prompt_tokens=1, completion_tokens=1)
    assert d.reservation.settled


async def test_keep_alive_heartbeats_the_lease() -> None:
    clock = FakeClock(1_000_000.0)
    inner = memory(clock, ttl=30)
    store = BrokenStore(inner)
    limiter = RateLimiter(store)
    d = await limiter.reserve(TENANT, 1)
    assert d.reservation is not None
    async with limiter.keep_alive(d.reservation):
        await asyncio.wait_for(store.heartbeated.wait(), 30)
    assert await limiter.heartbeat(d.reservation)
    clock.advance(31)
    assert not await limiter.heartbeat(d.reservation)


async def test_negative_tokens_are_a_value_error() -> None:
    limiter = RateLimiter(memory(FakeClock(1_000_000.0)))
    with pytest.raises(ValueError, match="num_tokens must be >= 0"):
        await limiter.reserve(TENANT, -1)


async def test_fail_open_share_still_fits_one_large_request() -> None:
    clock = FakeClock(1_000_000.0)
    store = BrokenStore(memory(clock))
    store.mode = "error"
    tenant = Tenant("big", LimitPolicy(tokens_per_minute=1000))
    limiter = RateLimiter(store, num_replicas=4, fallback=memory(clock))
    d = await limiter.reserve(tenant, 600)  # the share's burst is 250, the request fits 1000
    assert d.source == "local"
    assert d.allowed
    assert d.policy == LimitPolicy(tokens_per_minute=250, token_burst=600)
    d = await limiter.reserve(tenant, 600)
    assert not d.allowed
    assert d.retry_after_ms == 144_000  # 600 tokens at the share's 250/min
    assert (await limiter.reserve(tenant, 1001)).retry_after_ms == -1


async def test_a_request_rate_denial_is_known_until_the_bucket_refills() -> None:
    limiter = RateLimiter(memory(FakeClock(1_000_000.0)))
    tenant = Tenant("rpm", LimitPolicy(requests_per_minute=60, request_burst=1))
    assert limiter.known_denial(tenant) is None
    assert (await limiter.reserve(tenant, 1)).allowed
    denied = await limiter.reserve(tenant, 1)
    assert not denied.allowed
    known = limiter.known_denial(tenant)  # no store call: the limiter remembers it
    assert known is not None
    assert not known.allowed
    assert 0 < known.retry_after_ms <= denied.retry_after_ms
    other = Tenant("other", LimitPolicy(requests_per_minute=60, request_burst=1))
    assert limiter.known_denial(other) is None


class LostReplyStore(BrokenStore):
    """The reserve runs in the store, then its answer is lost (error) or never comes (hang)."""

    def __init__(self, inner: MemoryStore, after: str) -> None:
        super().__init__(inner)
        self.after = after
        self.ran = asyncio.Event()  # the reserve took its tokens and lease

    async def reserve(self, *args: Any, **kwargs: Any) -> Outcome:
        outcome = await self.inner.reserve(*args, **kwargs)
        self.ran.set()
        if self.after == "error":
            raise StoreError("connection reset while reading the reply")
        await asyncio.sleep(3600)
        return outcome


async def _drain(limiter: RateLimiter) -> None:
    for _ in range(100):
        if not limiter._background:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("compensation still running")


async def assert_store_holds(store: MemoryStore, tokens: float, leases: int) -> None:
    usage = await store.usage(TENANT.tenant_id, TENANT.limits)
    assert (usage.tokens_available, usage.concurrent_in_use) == (tokens, leases)


@pytest.mark.parametrize("after", ["error", "hang"])
async def test_a_reserve_with_a_lost_answer_is_compensated_by_lease_id(after: str) -> None:
    """Timeout (the guard's 100 ms) or error after the script ran: the tokens and the
    lease it took in the shared store come back; the request falls back to local."""
    inner = memory(FakeClock(1_000_000.0))
    limiter = RateLimiter(LostReplyStore(inner, after), timeout_ms=100)  # type: ignore[arg-type]
    d = await limiter.reserve(TENANT, 1000)
    assert d.allowed  # fail-open: the local share decided
    await _drain(limiter)
    await assert_store_holds(inner, 6000, 0)


async def test_a_cancelled_reserve_is_compensated() -> None:
    inner = memory(FakeClock(1_000_000.0))
    store = LostReplyStore(inner, "hang")
    limiter = RateLimiter(store, timeout_ms=10_000)  # type: ignore[arg-type]
    task = asyncio.create_task(limiter.reserve(TENANT, 1000))
    await store.ran.wait()  # the script ran; the answer never comes
    await assert_store_holds(inner, 5000, 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await _drain(limiter)
    await assert_store_holds(inner, 6000, 0)


async def test_compensation_never_refunds_a_reserve_that_did_not_run() -> None:
    inner = memory(FakeClock(1_000_000.0))
    broken = BrokenStore(inner)
    broken.mode = "error"  # fails before the script runs
    limiter = RateLimiter(broken)  # type: ignore[arg-type]
    first = await RateLimiter(inner).reserve(TENANT, 1000)  # someone else's live reservation
    assert first.allowed
    await limiter.reserve(TENANT, 2000)
    broken.mode = "ok"
    await _drain(limiter)
    await assert_store_holds(inner, 5000, 1)  # not 7000: nothing was given back


async def test_a_reserve_the_open_breaker_skipped_is_not_compensated() -> None:
    """Nothing was sent, so nothing is undone: while the breaker is open, fallback
    decisions do not queue a compensation each (thousands in an outage, all sent
    when the store comes back)."""
    store = BrokenStore(memory(FakeClock(1_000_000.0)))
    limiter = RateLimiter(store, breaker=store_breaker(1, 60_000))
    store.mode = "error"
    await limiter.reserve(TENANT, 1)  # failed in the store: it may have run
    first = set(limiter._background)
    assert len(first) == 1
    for _ in range(5):
        assert (await limiter.reserve(TENANT, 1)).source == "local"
    assert set(limiter._background) <= first
    assert store.num_calls == 1
    await _drain(limiter)
