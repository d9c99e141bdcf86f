"""A circuit breaker so a dead Redis does not cost the timeout on every request.

    CLOSED --(failure_threshold consecutive failures)--> OPEN
    OPEN   --(open_ms elapsed; next caller is the probe)--> HALF_OPEN
    HALF_OPEN --probe succeeds--> CLOSED      --probe fails--> OPEN

While OPEN (and while a half-open probe is in flight) ``allow()`` is False
and callers go straight to their fallback. The clock is injected.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable


class BreakerState(enum.IntEnum):
    """Breaker states; the value is exported as a gauge."""

    CLOSED = 0
    HALF_OPEN = 1
    OPEN = 2


class CircuitBreaker:
    """Consecutive-failure breaker with one probe at a time after ``open_ms``.

    Args:
        failure_threshold: Consecutive failures that open the breaker.
        open_ms: How long the breaker stays open before letting one probe through.
        clock: Monotonic milliseconds.
        on_change: Called with the new state on every transition.
    """

    def __init__(
        self,
        failure_threshold: int,
        open_ms: int,
        clock: Callable[[], float] | None = None,
        on_change: Callable[[BreakerState], None] | None = None,
    ) -> None:
        self.failure_threshold = failure_threshold
        self.open_ms = open_ms
        self.clock = clock or (lambda: time.monotonic() * 1000.0)
        self.on_change = on_change
        self.state = BreakerState.CLOSED
        self.num_failures = 0
        self._opened_at = 0.0
        self._probe_in_flight = False

    def allow(self) -> bool:
        """True when the caller may use the protected store now."""
        if self.state == BreakerState.CLOSED:
            return True
        if self.state == BreakerState.OPEN:
            if self.clock() - self._opened_at < self.open_ms:
                return False
            self._set(BreakerState.HALF_OPEN)
        if self._probe_in_flight:
            return False
        self._probe_in_flight = True
        return True

    def record_success(self) -> None:
        """A call through the breaker succeeded."""
        self.num_failures = 0
        self._probe_in_flight = False
        if self.state != BreakerState.CLOSED:
            self._set(BreakerState.CLOSED)

    def record_failure(self) -> None:
        """A call through the breaker failed (error or timeout)."""
        self.num_failures += 1
        self._probe_in_flight = False
        if self.state == BreakerState.HALF_OPEN or self.num_failures >= self.failure_threshold:
            self._opened_at = self.clock()
            if self.state != BreakerState.OPEN:
                self._set(BreakerState.OPEN)

    def cancel_probe(self) -> None:
        """The call let through by ``allow()`` was cancelled before it finished."""
        self._probe_in_flight = False

    def _set(self, state: BreakerState) -> None:
        self.state = state
        if self.on_change is not None:
            self.on_change(state)
