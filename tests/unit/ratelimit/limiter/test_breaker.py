"""The breaker around Redis (``store_breaker``: the shared circuit breaker with the
consecutive-failure policy) under a fake millisecond clock."""

from __future__ import annotations

from common.breaker import BreakerState, CircuitBreaker, Ticket
from ratelimit.store_guard import store_breaker
from tests.support.clock import FakeClock


def state_of(breaker: CircuitBreaker) -> BreakerState:
    return breaker.state


def fail(b: CircuitBreaker) -> None:
    ticket = b.admit()
    assert ticket is not None
    b.record(False, ticket)


def test_opens_after_threshold_and_probes_once() -> None:
    clock = FakeClock()
    changes: list[BreakerState] = []
    b = store_breaker(3, 1000, clock_ms=clock, on_change=lambda _, s: changes.append(s))
    for _ in range(2):
        fail(b)
    assert state_of(b) == BreakerState.CLOSED
    assert b.consecutive_failures == 2
    fail(b)
    assert state_of(b) == BreakerState.OPEN
    assert b.admit() is None
    clock.now = 999.0
    assert b.admit() is None
    clock.now = 1000.0
    probe = b.admit()  # the probe
    assert probe is not None
    assert state_of(b) == BreakerState.HALF_OPEN
    assert b.admit() is None  # one probe at a time
    b.record(False, probe)
    assert state_of(b) == BreakerState.OPEN
    clock.now = 2000.0  # the same open time again: no doubling around Redis
    probe = b.admit()
    assert probe is not None
    b.record(True, probe)
    assert state_of(b) == BreakerState.CLOSED
    assert b.admit() is not None
    assert changes == [
        BreakerState.OPEN,
        BreakerState.HALF_OPEN,
        BreakerState.OPEN,
        BreakerState.HALF_OPEN,
        BreakerState.CLOSED,
    ]


def test_success_resets_the_failure_count_and_no_error_ratio_applies() -> None:
    b = store_breaker(2, 1000, clock_ms=FakeClock())
    for _ in range(50):  # one failure in two: a ratio rule would have opened it
        fail(b)
        ticket = b.admit()
        assert ticket is not None
        b.record(True, ticket)
    assert state_of(b) == BreakerState.CLOSED
    assert b.consecutive_failures == 0


def test_a_cancelled_probe_frees_the_slot() -> None:
    clock = FakeClock()
    b = store_breaker(1, 10, clock_ms=clock)
    fail(b)
    clock.now = 10.0
    probe = b.admit()
    assert isinstance(probe, Ticket)
    b.record(None, probe)  # cancelled: neutral
    assert state_of(b) == BreakerState.HALF_OPEN
    assert b.admit() is not None
