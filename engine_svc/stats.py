"""What an engine reports about itself: its stats snapshot and recent throughput.

At the engine service's floor: the backends fill these in, the metrics collector and
the servicer read them.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass

from engine_svc.core.outputs import EngineStats


@dataclass(slots=True)
class BackendStats:
    """Engine snapshot plus recent throughput."""

    engine: EngineStats
    prompt_tokens_per_second: float = 0.0
    generation_tokens_per_second: float = 0.0


class RateWindow:
    """Prompt and generation tokens/s over the last ``window_s`` seconds, from the
    engine's running totals (one sample kept every ``every_s``)."""

    def __init__(self, window_s: float = 10.0, every_s: float = 0.25) -> None:
        self.window_s, self.every_s = window_s, every_s
        self._history: collections.deque[tuple[float, int, int]] = collections.deque()

    def record(self, prompt_total: int, generation_total: int, now: float | None = None) -> None:
        """Note the totals (cheap to call on every step: most calls keep nothing)."""
        now = time.monotonic() if now is None else now
        h = self._history
        if not h or now - h[-1][0] >= self.every_s:
            h.append((now, prompt_total, generation_total))
            while h and now - h[0][0] > self.window_s:
                h.popleft()

    def rates(self) -> tuple[float, float]:
        """(prompt tokens/s, generation tokens/s); zeros until two samples exist."""
        hist = list(self._history)
        if len(hist) < 2 or hist[-1][0] <= hist[0][0]:
            return 0.0, 0.0
        dt = hist[-1][0] - hist[0][0]
        return (hist[-1][1] - hist[0][1]) / dt, (hist[-1][2] - hist[0][2]) / dt
