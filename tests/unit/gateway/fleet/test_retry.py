"""Retry classification, backoff and the retry budget with a fake clock."""

from __future__ import annotations

import grpc

from gateway.fleet.retry import RetryBudget, RetryPolicy, breaker_verdict, is_retryable
from tests.support.clock import FakeClock


def test_only_unavailable_and_engine_queue_full_are_retryable() -> None:
    assert is_retryable(grpc.StatusCode.UNAVAILABLE)
    assert is_retryable(grpc.StatusCode.RESOURCE_EXHAUSTED)
    for code in (
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.CANCELLED,
    ):
        assert not is_retryable(code)


def test_breaker_verdicts() -> None:
    assert breaker_verdict(None) is True
    assert breaker_verdict(grpc.StatusCode.UNAVAILABLE) is False
    assert breaker_verdict(grpc.StatusCode.INTERNAL) is False
    for code in (
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.DEADLINE_EXCEEDED,
    ):
        assert breaker_verdict(code) is None


def test_backoff_is_full_jitter_and_capped() -> None:
    p = RetryPolicy(max_attempts=5, backoff_base_s=0.025, backoff_max_s=0.1)
    assert p.backoff(0, rng=lambda: 1.0) == 0.025
    assert p.backoff(1, rng=lambda: 1.0) == 0.05
    assert p.backoff(5, rng=lambda: 1.0) == 0.1
    assert p.backoff(3, rng=lambda: 0.0) == 0.0


def test_budget_allows_ratio_plus_floor_in_window() -> None:
    clock = FakeClock()
    budget = RetryBudget(ratio=0.2, min_retries=2, window_s=10, clock=clock)
    for _ in range(100):
        budget.record_request()
    allowed = sum(budget.try_withdraw() for _ in range(50))
    assert allowed == 22  # 2 + 20% of 100
    assert budget.num_retries == 22
    clock.advance(10.5)  # the window moves on: nothing recorded, only the floor
    assert budget.try_withdraw()
    assert budget.try_withdraw()
    assert not budget.try_withdraw()


def test_budget_without_floor_never_exceeds_ratio() -> None:
    clock = FakeClock()
    budget = RetryBudget(ratio=0.2, min_retries=0, window_s=10, clock=clock)
    retries = requests = 0
    for _ in range(1000):
        clock.advance(0.01)
        budget.record_request()
        requests += 1
        while budget.try_withdraw():  # every request wants retries (an outage)
            retries += 1
    assert retries <= 0.2 * requests
