"""The local memo of request-rate denials, with a fake clock."""

from __future__ import annotations

import dataclasses

from ratelimit.config import Dimension, LimitPolicy
from ratelimit.limiter.decision import Decision
from ratelimit.limiter.denials import DenialMemo

POLICY = LimitPolicy(requests_per_minute=60)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


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
    clock = Clock()
    memo = DenialMemo(clock)
    assert memo.check("t", POLICY) is None
    memo.record("t", POLICY, denial(Dimension.REQUESTS, 1000))
    clock.now += 0.4
    hit = memo.check("t", POLICY)
    assert hit is not None
    assert not hit.allowed
    assert hit.retry_after_ms == 600  # the remaining wait, not the original one
    clock.now += 0.6
    assert memo.check("t", POLICY) is None  # refilled: Redis decides again
    assert memo.check("other", POLICY) is None


def test_denials_with_a_request_shortage_are_memoised_for_the_request_wait() -> None:
    memo = DenialMemo(Clock())
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
    memo = DenialMemo(Clock())
    memo.record("t", POLICY, denial(Dimension.REQUESTS, 5000))
    assert memo.check("t", LimitPolicy(requests_per_minute=600)) is None
    assert memo.check("t", POLICY) is None  # dropped for good


def test_memory_is_bounded() -> None:
    clock = Clock()
    memo = DenialMemo(clock, max_tenants=10)
    for i in range(25):
        memo.record(f"t{i}", POLICY, denial(Dimension.REQUESTS, 1000 + i))
    assert len(memo._memos) <= 10
    assert memo.check("t24", POLICY) is not None  # the newest survive
