"""Circuit breaker transitions under a fake clock."""

from __future__ import annotations

from ratelimit.limiter.breaker import BreakerState, CircuitBreaker


def state_of(breaker: CircuitBreaker) -> BreakerState:
    return breaker.state


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_opens_after_threshold_and_probes_once() -> None:
    clock = Clock()
    changes: list[BreakerState] = []
    b = CircuitBreaker(3, 1000, clock=clock, on_change=changes.append)
    for _ in range(2):
        assert b.allow()
        b.record_failure()
    assert state_of(b) == BreakerState.CLOSED
    assert b.allow()
    b.record_failure()
    assert state_of(b) == BreakerState.OPEN
    assert not b.allow()
    clock.now = 999.0
    assert not b.allow()
    clock.now = 1000.0
    assert b.allow()  # the probe
    assert state_of(b) == BreakerState.HALF_OPEN
    assert not b.allow()  # one probe at a time
    b.record_failure()
    assert state_of(b) == BreakerState.OPEN
    clock.now = 2000.0
    assert b.allow()
    b.record_success()
    assert state_of(b) == BreakerState.CLOSED
    assert b.allow()
    assert changes == [
        BreakerState.OPEN,
        BreakerState.HALF_OPEN,
        BreakerState.OPEN,
        BreakerState.HALF_OPEN,
        BreakerState.CLOSED,
    ]


def test_success_resets_the_failure_count() -> None:
    b = CircuitBreaker(2, 1000, clock=Clock())
    b.record_failure()
    b.record_success()
    b.record_failure()
    assert state_of(b) == BreakerState.CLOSED


def test_cancelled_probe_frees_the_slot() -> None:
    clock = Clock()
    b = CircuitBreaker(1, 10, clock=clock)
    b.record_failure()
    clock.now = 10.0
    assert b.allow()
    b.cancel_probe()
    assert b.allow()
