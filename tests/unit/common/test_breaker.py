"""Circuit breaker state machine with a fake clock."""

from __future__ import annotations

from common.breaker import BreakerGroup, BreakerPolicy, BreakerState, CircuitBreaker
from tests.support.clock import FakeClock

POLICY = BreakerPolicy(
    window_s=10,
    min_calls=4,
    error_ratio=0.5,
    consecutive_failures=3,
    open_s=5,
    max_open_s=20,
    half_open_probes=1,
)


def breaker(clock: FakeClock, policy: BreakerPolicy = POLICY) -> CircuitBreaker:
    return CircuitBreaker("r", policy, clock=clock)


def state(b: CircuitBreaker) -> BreakerState:
    return b.state  # a call, so mypy does not narrow the property between reads


def call(b: CircuitBreaker, ok: bool | None) -> None:
    ticket = b.admit()
    assert ticket
    b.record(ok, ticket)


def test_consecutive_failures_open_then_half_open_probe_closes() -> None:
    clock = FakeClock(100.0)
    b = breaker(clock)
    for _ in range(2):
        call(b, False)
    assert state(b) == BreakerState.CLOSED
    call(b, False)
    assert state(b) == BreakerState.OPEN
    assert not b.available()
    clock.advance(5)
    assert state(b) == BreakerState.HALF_OPEN
    probe = b.admit()  # the one probe
    assert probe
    assert not b.available()  # no second probe while it runs
    b.record(True, probe)
    assert state(b) == BreakerState.CLOSED


def test_failed_probe_reopens_with_doubled_open_time() -> None:
    clock = FakeClock(100.0)
    b = breaker(clock)
    for _ in range(3):
        call(b, False)
    clock.advance(5)
    call(b, False)  # probe fails
    assert state(b) == BreakerState.OPEN
    clock.advance(9.9)
    assert state(b) == BreakerState.OPEN  # 10 s now
    clock.advance(0.1)
    assert state(b) == BreakerState.HALF_OPEN


def test_error_ratio_needs_min_calls_and_uses_a_rolling_window() -> None:
    clock = FakeClock(100.0)
    b = breaker(
        clock, BreakerPolicy(window_s=10, min_calls=4, error_ratio=0.5, consecutive_failures=100)
    )
    call(b, False)
    call(b, True)
    call(b, False)
    assert state(b) == BreakerState.CLOSED  # 3 calls < min_calls
    call(b, True)
    call(b, False)  # 3/5 failed >= 50%
    assert state(b) == BreakerState.OPEN

    b2 = breaker(
        clock, BreakerPolicy(window_s=10, min_calls=4, error_ratio=0.5, consecutive_failures=100)
    )
    call(b2, False)
    call(b2, False)
    call(b2, True)
    clock.advance(11)  # the old calls leave the window
    call(b2, True)
    call(b2, True)
    call(b2, True)
    call(b2, False)
    assert state(b2) == BreakerState.CLOSED  # 1/4 in the window


def test_neutral_outcomes_do_not_count() -> None:
    clock = FakeClock(100.0)
    b = breaker(clock)
    for _ in range(10):
        call(b, None)
    assert state(b) == BreakerState.CLOSED


def test_group_ejects_at_most_half_and_always_one() -> None:
    clock = FakeClock(100.0)
    changes: list[tuple[str, BreakerState]] = []
    group = BreakerGroup(POLICY, 0.5, clock=clock, on_change=lambda n, s: changes.append((n, s)))
    bs = [group.add(f"r{i}") for i in range(4)]
    assert group.max_ejected() == 2
    for b in bs:
        for _ in range(3):
            call(b, False) if b.available() else None
    assert [b.state for b in bs].count(BreakerState.OPEN) == 2
    assert changes == [("r0", BreakerState.OPEN), ("r1", BreakerState.OPEN)]
    single = BreakerGroup(POLICY, 0.5, clock=clock)
    only = single.add("only")
    for _ in range(3):
        call(only, False)
    assert state(only) == BreakerState.OPEN  # one replica: it may still be ejected


def test_only_the_admitted_probe_decides_the_half_open_state() -> None:
    """A stream admitted before the trip that ends during half-open is not the probe:
    neither its success closes the breaker nor its failure reopens it."""
    clock = FakeClock(100.0)
    b = breaker(clock)
    old_ok, old_bad = b.admit(), b.admit()
    assert old_ok
    assert old_bad
    for _ in range(3):
        call(b, False)
    assert state(b) == BreakerState.OPEN
    clock.advance(5)
    probe = b.admit()
    assert probe
    assert probe.probe > 0
    b.record(True, old_ok)  # a long stream from before the trip finishes fine
    assert state(b) == BreakerState.HALF_OPEN
    assert not b.available()  # the probe slot is still taken
    b.record(False, old_bad)
    assert state(b) == BreakerState.HALF_OPEN
    b.record(True, probe)
    assert state(b) == BreakerState.CLOSED


def test_a_probe_of_an_earlier_half_open_period_does_not_count() -> None:
    clock = FakeClock(100.0)
    b = breaker(
        clock,
        BreakerPolicy(
            window_s=10,
            min_calls=4,
            error_ratio=0.5,
            consecutive_failures=3,
            open_s=5,
            max_open_s=20,
            half_open_probes=2,
        ),
    )
    for _ in range(3):
        call(b, False)
    clock.advance(5)
    p1, p2 = b.admit(), b.admit()
    assert p1
    assert p2
    b.record(False, p1)  # a probe fails: open again, for 10 s
    assert state(b) == BreakerState.OPEN
    clock.advance(10)
    assert state(b) == BreakerState.HALF_OPEN  # a new half-open period
    b.record(True, p2)  # the earlier period's other probe ends now: says nothing
    assert state(b) == BreakerState.HALF_OPEN
    q1, q2 = b.admit(), b.admit()
    assert q1
    assert q2
    assert not b.available()  # p2 did not free one of this period's slots
    b.record(True, q1)
    b.record(True, q2)
    assert state(b) == BreakerState.CLOSED


def test_a_replica_that_never_fails_keeps_only_its_window_of_calls() -> None:
    """The error-ratio window forgets calls as they age out, not only when a failure
    is judged: a healthy replica must not keep every call it ever served."""
    clock = FakeClock(100.0)
    b = breaker(clock)
    for _ in range(5000):
        clock.advance(0.01)
        call(b, True)
    # 10 s window at one call per 10 ms
    assert len(b._calls) <= 1001  # the memory bound is the point
