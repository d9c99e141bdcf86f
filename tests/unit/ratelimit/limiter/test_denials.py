"""The local memo of request-rate denials, with a fake clock."""

from __future__ import annotations

import dataclasses

from hypothesis import given
from hypothesis import strategies as st

from ratelimit.config import Dimension, LimitPolicy
from ratelimit.limiter.decision import Decision
from ratelimit.limiter.denials import DenialMemo, HeadroomMemo
from tests.support.clock import FakeClock

POLICY = LimitPolicy(requests_per_minute=60)


def denial(denied: Dimension, retry_after_ms: int) -> Decision:
    return Decision(
        allowed=False,
        retry_after_ms=retry_after_ms,
        denied=denied,
        reservation=None,
        requests_remaining=0,
        tokens_remaining=-1,
        concurrent_in_use=0,
        source="redis",
        shadow_denied=False,
        server_time_ms=0.0,
        tenant_id="t",
        num_tokens=10,
        policy=POLICY,
    )


def test_request_rate_denial_is_answered_locally_until_the_bucket_refills() -> None:
    clock = FakeClock(100.0)
    memo = DenialMemo(clock)
    assert memo.check("t", POLICY) is None
    memo.record("t", POLICY, denial(Dimension.REQUESTS, 1000))
    clock.advance(0.4)
    hit = memo.check("t", POLICY)
    assert hit is not None
    assert not hit.allowed
    assert hit.retry_after_ms == 600  # the remaining wait, not the original one
    clock.advance(0.6)
    assert memo.check("t", POLICY) is None  # refilled: Redis decides again
    assert memo.check("other", POLICY) is None


def test_denials_with_a_request_shortage_are_memoised_for_the_request_wait() -> None:
    memo = DenialMemo(FakeClock(100.0))
    for dims in (Dimension.TOKENS, Dimension.CONCURRENCY, Dimension.TOKENS | Dimension.CONCURRENCY):
        memo.record("t", POLICY, denial(dims, 1000))  # refunds/releases may end these early
        assert memo.check("t", POLICY) is None
    # requests and tokens short: the token wait (30 s) could end early, the request one
    # (one request at 60/min = 1 s) cannot, so that is what is memoised
    memo.record("t", POLICY, denial(Dimension.REQUESTS | Dimension.TOKENS, 30_000))
    hit = memo.check("t", POLICY)
    assert hit is not None
    assert (hit.denied, hit.retry_after_ms) == (Dimension.REQUESTS, 1000)
    half = dataclasses.replace(denial(Dimension.REQUESTS, 999), requests_remaining=0.5)
    memo.record("u", POLICY, half)
    hit = memo.check("u", POLICY)
    assert hit is not None
    assert hit.retry_after_ms == 500  # half a request left: half the wait
    shared = dataclasses.replace(denial(Dimension.REQUESTS, 999), policy=POLICY.divided(2))
    memo.record("v", POLICY, shared)  # a fail-open share refills at its own, slower rate
    hit = memo.check("v", POLICY)
    assert hit is not None
    assert hit.retry_after_ms == 2000


def test_a_changed_policy_drops_the_memo() -> None:
    memo = DenialMemo(FakeClock(100.0))
    memo.record("t", POLICY, denial(Dimension.REQUESTS, 5000))
    assert memo.check("t", LimitPolicy(requests_per_minute=600)) is None
    assert memo.check("t", POLICY) is None  # dropped for good


def test_memory_is_bounded() -> None:
    clock = FakeClock(100.0)
    memo = DenialMemo(clock, max_tenants=10)
    for i in range(25):
        memo.record(f"t{i}", POLICY, denial(Dimension.REQUESTS, 1000 + i))
    assert len(memo._memos) <= 10
    assert memo.check("t24", POLICY) is not None  # the newest survive


def admitted(requests_left: float, leases: int, policy: LimitPolicy = POLICY) -> Decision:
    return dataclasses.replace(
        denial(Dimension.NONE, 0),
        allowed=True,
        requests_remaining=requests_left,
        concurrent_in_use=leases,
        policy=policy,
    )


def test_headroom_needs_an_admission_seen_here_under_the_same_policy() -> None:
    clock = FakeClock(100.0)
    memo = HeadroomMemo(clock, margin=2)
    assert not memo.has_headroom("t", POLICY)  # nothing seen: the two-call path
    memo.record("t", POLICY, admitted(5, 0))
    assert memo.has_headroom("t", POLICY)
    assert not memo.has_headroom("t", LimitPolicy(requests_per_minute=30))  # policy changed
    memo.record("t", POLICY, denial(Dimension.TOKENS, 100))  # a refusal clears it
    assert not memo.has_headroom("t", POLICY)


def test_request_headroom_refills_at_the_policy_rate_up_to_the_burst() -> None:
    clock = FakeClock(100.0)
    memo = HeadroomMemo(clock, margin=2)
    memo.record("t", POLICY, admitted(0.5, 0))  # 60/min: one request per second
    assert not memo.has_headroom("t", POLICY)
    clock.advance(1.0)  # 1.5 requests
    assert not memo.has_headroom("t", POLICY)
    clock.advance(0.5)  # 2.0
    assert memo.has_headroom("t", POLICY)
    tiny = LimitPolicy(requests_per_minute=60, request_burst=1)  # never 2 in the bucket
    memo.record("u", tiny, admitted(1, 0, tiny))
    clock.advance(100)
    assert not memo.has_headroom("u", tiny)


def test_lease_headroom_and_unlimited_dimensions() -> None:
    memo = HeadroomMemo(FakeClock(100.0), margin=2)
    conc = LimitPolicy(max_concurrent=4)
    memo.record("t", conc, admitted(-1, 3, conc))  # one lease free
    assert not memo.has_headroom("t", conc)
    memo.record("t", conc, admitted(-1, 2, conc))
    assert memo.has_headroom("t", conc)
    free = LimitPolicy()
    memo.record("u", free, admitted(-1, 100, free))  # no limits at all
    assert memo.has_headroom("u", free)


def test_headroom_memory_is_bounded_and_keeps_the_newest() -> None:
    memo = HeadroomMemo(FakeClock(100.0), max_tenants=10, margin=2)
    for i in range(25):
        memo.record(f"t{i}", POLICY, admitted(5, 0))
    memo.record("t0", POLICY, admitted(5, 0))  # seen again: newest now
    assert len(memo._seen) <= 10
    assert memo.has_headroom("t24", POLICY)
    assert memo.has_headroom("t0", POLICY)
    assert not memo.has_headroom("t5", POLICY)  # forgotten: the two-call path again


TOKENS = LimitPolicy(requests_per_minute=600, tokens_per_minute=600, max_concurrent=8)


def seen_with(tokens_left: float, requests_left: float = 50, leases: int = 0) -> Decision:
    return dataclasses.replace(
        admitted(requests_left, leases, TOKENS), tokens_remaining=tokens_left, policy=TOKENS
    )


def test_a_claim_needs_headroom_and_the_tokens_and_spends_them_from_the_estimate() -> None:
    clock = FakeClock(100.0)
    memo = HeadroomMemo(clock, margin=2)
    assert not memo.claim("t", TOKENS, 1)  # nothing seen here
    memo.record("t", TOKENS, seen_with(100))
    assert not memo.claim("t", TOKENS, 101)  # more than the bucket held
    assert memo.claim("t", TOKENS, 60)
    assert not memo.claim("t", TOKENS, 60)  # 40 left in the estimate
    assert memo.claim("t", TOKENS, 40)
    assert not memo.claim("t", TOKENS, 1)
    clock.advance(1.0)  # 600/min: 10 tokens a second
    assert memo.claim("t", TOKENS, 10)
    memo.record("t", TOKENS, seen_with(500))  # the store's answer replaces the estimate
    assert memo.claim("t", TOKENS, 400)
    memo.record("t", TOKENS, denial(Dimension.TOKENS, 100))  # a refusal: no claims at all
    assert not memo.claim("t", TOKENS, 1)


def test_claims_take_leases_and_requests_from_the_estimate() -> None:
    memo = HeadroomMemo(FakeClock(100.0), margin=2)
    memo.record("t", TOKENS, seen_with(-1, requests_left=50, leases=3))  # 5 leases free
    claims = sum(memo.claim("t", TOKENS, 1) for _ in range(10))
    assert claims == 4  # until fewer than the margin of 2 leases are free
    memo.record("u", TOKENS, seen_with(-1, requests_left=5, leases=0))
    assert sum(memo.claim("u", TOKENS, 1) for _ in range(10)) == 4  # 5, 4, 3, 2 left


@given(
    tokens_left=st.integers(0, 10_000),
    requests_left=st.integers(0, 60),
    leases=st.integers(0, 8),
    sizes=st.lists(st.integers(0, 3_000), max_size=40),
)
def test_a_burst_of_claims_never_spends_more_than_the_memo_saw(
    tokens_left: int, requests_left: int, leases: int, sizes: list[int]
) -> None:
    """Without time passing or a store answer, what every successful claim took adds up
    to no more than the last admission left: tokens, requests and leases."""
    memo = HeadroomMemo(FakeClock(100.0), margin=2)
    memo.record("t", TOKENS, seen_with(tokens_left, requests_left, leases))
    granted = [n for n in sizes if memo.claim("t", TOKENS, n)]
    assert sum(granted) <= tokens_left
    assert len(granted) <= max(0, requests_left - 1)  # each needs 2 left, spends 1
    assert len(granted) <= max(0, TOKENS.max_concurrent - leases - 1)
