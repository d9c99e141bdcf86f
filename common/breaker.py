"""Circuit breakers: closed -> open -> half-open -> closed. The gateway keeps one per
engine replica (``BreakerGroup``, with an ejection cap); the rate limiter one around
Redis (``BreakerPolicy.consecutive``: N failures in a row, a fixed open time).

    CLOSED ──(consecutive failures >= N, or error ratio >= R over >= M calls
    │         in the rolling window; and the ejection cap allows it)──► OPEN
    ▲                                                                  │ open_s elapsed
    │  all probes succeed                                              ▼ (doubling per trip,
    └──────────────────────────── HALF_OPEN ◄──────────────────────────┘  up to max_open_s)
                                      │ a probe fails ──► OPEN again

Outcomes are reported by the pipeline from what the engine call ended with,
including statuses that only arrive in trailers after a stream started
(which Envoy's outlier detection cannot see). Client cancels and queue-full
answers are neutral: they say nothing about the replica's health. A
``BreakerGroup`` caps how many replicas may be ejected at once (at most
``max_ejected_fraction`` of them, at least one), so a fault that hits every
replica does not turn into a full outage by the breakers alone.
"""

from __future__ import annotations

import enum
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass


class BreakerState(enum.IntEnum):
    """Values exported as ``gateway_breaker_state`` (0 closed, 1 half-open, 2 open)."""

    CLOSED = 0
    HALF_OPEN = 1
    OPEN = 2


@dataclass(frozen=True, slots=True)
class BreakerPolicy:
    """Thresholds of one breaker (the gateway's per-replica breakers: ``gateway.breaker``).

    Attributes:
        window_s: Rolling window, in seconds, the error ratio is measured over.
        min_calls: Calls the window must hold before the error ratio can trip the breaker.
        error_ratio: Share of failed calls in the window that trips the breaker.
        consecutive_failures: Failures in a row that trip the breaker, whatever the ratio.
        open_s: How long the first trip keeps the breaker open; each further trip
            without a recovery doubles it.
        max_open_s: The longest an open period grows to.
        half_open_probes: Calls let through after the open period; all of them must
            succeed to close the breaker, one failure opens it again.
    """

    window_s: float = 10.0
    min_calls: int = 10
    error_ratio: float = 0.5
    consecutive_failures: int = 5
    open_s: float = 5.0
    max_open_s: float = 60.0
    half_open_probes: int = 1

    def validate(self) -> None:
        """Raises ValueError naming the first threshold out of range."""
        for name in ("min_calls", "consecutive_failures", "open_s", "half_open_probes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 0.0 <= self.error_ratio <= 1.0:
            raise ValueError(f"error_ratio must be in [0, 1], got {self.error_ratio}")

    @classmethod
    def consecutive(cls, failures: int, open_s: float) -> BreakerPolicy:
        """Open after ``failures`` failures in a row (no error-ratio rule), for ``open_s``
        every time (no doubling), then let one probe through."""
        return cls(
            consecutive_failures=failures,
            error_ratio=math.inf,
            open_s=open_s,
            max_open_s=open_s,
            half_open_probes=1,
        )


@dataclass(frozen=True, slots=True)
class Ticket:
    """What ``admit`` gave one call; hand it back to ``record`` when the call ends.

    ``probe`` is the half-open period the call probes (0: an ordinary call), so a
    stream admitted before the breaker tripped cannot pass for the probe when it
    ends during the half-open period.
    """

    probe: int = 0

    def __bool__(self) -> bool:  # admitted
        return True


ORDINARY = Ticket()


class CircuitBreaker:
    """One replica's breaker.

    Args:
        name: The replica (metric label).
        policy: Thresholds.
        clock: Monotonic seconds (injectable for tests).
        may_open: Asked before tripping; False keeps the breaker closed (ejection cap).
        on_change: Called with (name, new state) on every transition.
    """

    def __init__(
        self,
        name: str,
        policy: BreakerPolicy,
        *,
        clock: Callable[[], float] = time.monotonic,
        may_open: Callable[[CircuitBreaker], bool] | None = None,
        on_change: Callable[[str, BreakerState], None] | None = None,
    ) -> None:
        self.name = name
        self.policy = policy
        self._clock = clock
        self._may_open = may_open or (lambda _: True)
        self._on_change = on_change
        self._state = BreakerState.CLOSED
        self._calls: deque[tuple[float, bool]] = deque()
        self._consecutive = 0
        self._num_trips = 0
        self._open_until = 0.0
        self._probes_in_flight = 0
        self._probe_successes = 0
        self._half_open_period = 0  # numbers the half-open periods (probe tickets)

    @property
    def consecutive_failures(self) -> int:
        """Failures since the last success."""
        return self._consecutive

    @property
    def state(self) -> BreakerState:
        """The current state; an OPEN breaker whose time is up reads HALF_OPEN."""
        if self._state == BreakerState.OPEN and self._clock() >= self._open_until:
            self._set(BreakerState.HALF_OPEN)
            self._probes_in_flight = self._probe_successes = 0
            self._half_open_period += 1
        return self._state

    def available(self) -> bool:
        """True when a call may be routed here now (no side effects)."""
        state = self.state
        if state == BreakerState.CLOSED:
            return True
        return (
            state == BreakerState.HALF_OPEN
            and self._probes_in_flight < self.policy.half_open_probes
        )

    def admit(self) -> Ticket | None:
        """Take a call; in HALF_OPEN this uses one probe slot. None when not available."""
        if not self.available():
            return None
        if self._state == BreakerState.HALF_OPEN:
            self._probes_in_flight += 1
            return Ticket(self._half_open_period)
        return ORDINARY

    def record(self, ok: bool | None, ticket: Ticket = ORDINARY) -> None:
        """Report the end of a call admitted by ``admit`` with its ticket: True success,
        False failure, None neutral.

        In HALF_OPEN only the probes of this half-open period decide; a call admitted
        before the trip that ends now says nothing about the replica's recovery.
        """
        half_open = self.state == BreakerState.HALF_OPEN
        probe = half_open and ticket.probe == self._half_open_period
        if probe and self._probes_in_flight > 0:
            self._probes_in_flight -= 1
        if ok is None or (half_open and not probe):
            return
        now = self._clock()
        if self.policy.error_ratio <= 1.0:  # the window serves the ratio rule only
            self._calls.append((now, ok))
            self._forget_before(now - self.policy.window_s)
        self._consecutive = 0 if ok else self._consecutive + 1
        if probe:
            self._record_probe(ok)
        elif self._state == BreakerState.CLOSED and not ok and self._should_trip(now):
            self._trip()

    def _record_probe(self, ok: bool) -> None:
        if not ok:
            self._trip(force=True)
            return
        self._probe_successes += 1
        if self._probe_successes >= self.policy.half_open_probes:
            self._calls.clear()
            self._consecutive = self._num_trips = 0
            self._set(BreakerState.CLOSED)

    def _forget_before(self, t: float) -> None:
        """Drop calls older than the window, as they are recorded: a replica that never
        fails must not keep every call it ever served."""
        while self._calls and self._calls[0][0] < t:
            self._calls.popleft()

    def _should_trip(self, now: float) -> bool:
        if self._consecutive >= self.policy.consecutive_failures:
            return True
        total = len(self._calls)
        failures = sum(1 for _, ok in self._calls if not ok)
        return total >= self.policy.min_calls and failures / total >= self.policy.error_ratio

    def _trip(self, force: bool = False) -> None:
        if not force and not self._may_open(self):
            return
        duration = min(self.policy.max_open_s, self.policy.open_s * 2**self._num_trips)
        self._num_trips += 1
        self._open_until = self._clock() + duration
        self._probes_in_flight = self._probe_successes = 0
        self._set(BreakerState.OPEN)

    def _set(self, state: BreakerState) -> None:
        if state != self._state:
            self._state = state
            if self._on_change is not None:
                self._on_change(self.name, state)


class BreakerGroup:
    """The breakers of one replica pool, with the ejection cap.

    Args:
        policy: Thresholds shared by every breaker.
        max_ejected_fraction: Share of breakers that may be not-CLOSED at once (>= 1 breaker).
        clock: Monotonic seconds.
        on_change: Transition callback (metrics, logs).
    """

    def __init__(
        self,
        policy: BreakerPolicy,
        max_ejected_fraction: float = 0.5,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[str, BreakerState], None] | None = None,
    ) -> None:
        self.policy = policy
        self.max_ejected_fraction = max_ejected_fraction
        self.breakers: dict[str, CircuitBreaker] = {}
        self._clock = clock
        self._on_change = on_change

    def add(self, name: str) -> CircuitBreaker:
        """Create (or return) the breaker of ``name``."""
        if name not in self.breakers:
            self.breakers[name] = CircuitBreaker(
                name,
                self.policy,
                clock=self._clock,
                may_open=self._may_open,
                on_change=self._on_change,
            )
        return self.breakers[name]

    def remove(self, name: str) -> None:
        """Forget the breaker of a replica that left the pool."""
        self.breakers.pop(name, None)

    def max_ejected(self) -> int:
        """How many breakers may be ejected (not CLOSED) at once."""
        return max(1, math.floor(len(self.breakers) * self.max_ejected_fraction))

    def num_ejected(self) -> int:
        """Breakers currently OPEN or HALF_OPEN."""
        return sum(1 for b in self.breakers.values() if b.state != BreakerState.CLOSED)

    def _may_open(self, breaker: CircuitBreaker) -> bool:
        return self.num_ejected() < self.max_ejected()
