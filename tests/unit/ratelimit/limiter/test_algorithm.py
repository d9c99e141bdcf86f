"""Token-bucket math: refill, burst, retry-after accuracy, no window-edge bursts."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ratelimit.config import Dimension, LimitPolicy
from ratelimit.limiter import algorithm
from ratelimit.limiter.algorithm import UNLIMITED, BucketState


def take(
    policy: LimitPolicy,
    state: BucketState | None,
    now: float,
    num_tokens: int = 0,
    shadow: bool = False,
    num_leases: int = 0,
) -> tuple[algorithm.Outcome, BucketState | None]:
    return algorithm.decide(
        policy,
        state,
        now,
        num_tokens=num_tokens,
        num_leases=num_leases,
        first_lease_expiry_ms=None,
        shadow=shadow,
        concurrency_retry_ms=1000,
    )


def test_fresh_bucket_is_full_and_burst_defaults_to_one_minute() -> None:
    policy = LimitPolicy(requests_per_minute=60, tokens_per_minute=6000)
    outcome, state = take(policy, None, 0.0, num_tokens=100)
    assert outcome.taken
    assert outcome.requests_left == 59
    assert outcome.tokens_left == 5900
    assert state == BucketState(59.0, 5900.0, 0.0)


def test_burst_caps_the_bucket() -> None:
    policy = LimitPolicy(requests_per_minute=600, request_burst=2)
    state = None
    admitted = 0
    for _ in range(5):
        outcome, state = take(policy, state, 0.0)
        admitted += outcome.taken
    assert admitted == 2
    # 100 ms at 10/s refills exactly one request
    outcome, state = take(policy, state, 100.0)
    assert outcome.taken
    outcome, _ = take(policy, state, 100.0)
    assert not outcome.allowed
    assert outcome.denied == Dimension.REQUESTS
    assert outcome.retry_after_ms == 100


def test_unlimited_dimensions_report_minus_one() -> None:
    outcome, state = take(LimitPolicy(), None, 5.0, num_tokens=10**9)
    assert outcome.taken
    assert outcome.requests_left == UNLIMITED
    assert outcome.tokens_left == UNLIMITED
    assert state == BucketState(None, None, 5.0)


def test_cost_above_capacity_can_never_pass() -> None:
    policy = LimitPolicy(tokens_per_minute=1000)
    outcome, state = take(policy, None, 0.0, num_tokens=1001)
    assert not outcome.allowed
    assert outcome.retry_after_ms == -1
    assert state is None


def test_denial_takes_nothing_from_any_dimension() -> None:
    policy = LimitPolicy(requests_per_minute=60, tokens_per_minute=100)
    outcome, state = take(policy, None, 0.0, num_tokens=80)
    outcome, state2 = take(policy, state, 0.0, num_tokens=30)
    assert outcome.denied == Dimension.TOKENS
    assert state2 == state  # the request was not charged either


def test_concurrency_denial_and_shadow_mode() -> None:
    policy = LimitPolicy(max_concurrent=2)
    outcome, _ = take(policy, None, 0.0, num_leases=2)
    assert not outcome.allowed
    assert outcome.denied == Dimension.CONCURRENCY
    assert outcome.retry_after_ms == 1000
    outcome, state = take(policy, None, 0.0, num_leases=2, shadow=True)
    assert outcome.allowed
    assert outcome.shadow_denied
    assert not outcome.taken
    assert outcome.num_leases == 2
    assert state is None


def test_refund_never_above_capacity_and_overrun_goes_negative() -> None:
    policy = LimitPolicy(tokens_per_minute=600)
    _, state = take(policy, None, 0.0, num_tokens=500)
    state = algorithm.refund(policy, state, 0.0, 450)
    assert state is not None
    assert state.tokens == 550
    state = algorithm.refund(policy, state, 0.0, 10_000)
    assert state is not None
    assert state.tokens == 600
    state = algorithm.refund(policy, state, 0.0, -700)
    assert state is not None
    assert state.tokens == -100


rates = st.integers(min_value=1, max_value=10_000_000)


@settings(max_examples=300, deadline=None)
@given(
    per_minute=rates,
    burst_factor=st.sampled_from([0, 1, 2]),
    level_frac=st.floats(min_value=0.0, max_value=0.999),
    cost_frac=st.floats(min_value=0.0, max_value=1.0),
)
def test_retry_after_is_exact_to_the_millisecond(
    per_minute: int, burst_factor: int, level_frac: float, cost_frac: float
) -> None:
    policy = LimitPolicy(tokens_per_minute=per_minute, token_burst=per_minute * burst_factor)
    cap = policy.token_capacity
    cost = max(1, round(cap * cost_frac))
    state = BucketState(None, cap * level_frac, 0.0)
    outcome, _ = take(policy, state, 0.0, num_tokens=cost)
    if outcome.allowed:
        return
    wait = outcome.retry_after_ms
    assert wait >= 1
    assert take(policy, state, float(wait), num_tokens=cost)[0].taken
    if wait > 1:
        assert not take(policy, state, float(wait - 1), num_tokens=cost)[0].allowed


@settings(max_examples=200, deadline=None)
@given(
    per_minute=st.integers(min_value=1, max_value=100_000),
    burst=st.integers(min_value=0, max_value=1000),
    gaps=st.lists(st.floats(min_value=0.0, max_value=5000.0), min_size=1, max_size=200),
    costs=st.lists(st.integers(min_value=0, max_value=50), min_size=1, max_size=200),
)
def test_no_interval_admits_more_than_capacity_plus_refill(
    per_minute: int, burst: int, gaps: list[float], costs: list[int]
) -> None:
    policy = LimitPolicy(tokens_per_minute=per_minute, token_burst=burst)
    state = None
    now = 0.0
    admitted: list[tuple[float, int]] = []
    for i, gap in enumerate(gaps):
        now += gap
        cost = costs[i % len(costs)]
        outcome, state = take(policy, state, now, num_tokens=cost)
        if outcome.taken:
            admitted.append((now, cost))
    # every interval [t_i, t_j] admits at most capacity + rate * (t_j - t_i) (+ rounding)
    for i in range(len(admitted)):
        total = 0
        for j in range(i, len(admitted)):
            total += admitted[j][1]
            span = admitted[j][0] - admitted[i][0]
            assert total <= policy.token_capacity + span * per_minute / 60_000 + 1e-6


@pytest.mark.parametrize(("elapsed", "expected"), [(0, 0.0), (-50, 0.0), (500, 5.0), (10**9, 10.0)])
def test_refill(elapsed: float, expected: float) -> None:
    assert algorithm.refill(0.0, 10, 600, elapsed) == expected
