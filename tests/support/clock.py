"""One fake clock for every test: time moves only when the test moves it.

Code under test takes a ``Callable[[], float]`` clock (seconds or milliseconds, as
that code expects); a :class:`FakeClock` is such a callable.
"""

from __future__ import annotations


class FakeClock:
    """A monotonic clock read as ``clock()`` and moved by ``advance`` or by setting ``now``.

    Args:
        now: the reading it starts at (in whatever unit the code under test uses).
    """

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, delta: float) -> float:
        """Moves the clock forward by ``delta`` (never backward) and returns the new reading."""
        if delta < 0:
            raise ValueError(f"a clock does not go back (delta {delta})")
        self.now += delta
        return self.now
