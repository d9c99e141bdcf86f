"""Per-version outcomes on this gateway replica: what the canary guard judges.

Every engine attempt (and every shadow call) that ends records one sample
for its (model, version): ok or error, and the attempt's time to first
token (attempt start -> first token: the engine's share, so the gateway's
own work does not blur the comparison). A request routed to a version that
had no replica able to take it counts as an error of that version: a
canary that cannot serve is failing, even when its traffic fell back to
the stable version and no client saw an error.

Samples live in a bounded deque per version; ``summary`` reads those newer
than ``since`` (the policy's last change, so a re-promoted candidate starts
clean) and inside the window.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

MAX_SAMPLES = 5000


@dataclass(frozen=True, slots=True)
class Sample:
    """One ended attempt."""

    at: float  # unix seconds
    ok: bool
    ttft_s: float | None  # None when no token came


@dataclass(frozen=True, slots=True)
class VersionSummary:
    """Outcomes of one version over a window."""

    num_requests: int
    num_errors: int
    ttft_p95_s: float | None  # None without a single first token

    @property
    def error_rate(self) -> float:
        """Errors per request (0 without requests)."""
        return self.num_errors / self.num_requests if self.num_requests else 0.0


def p95(values: list[float]) -> float | None:
    """The 95th percentile (nearest rank), None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


class VersionStats:
    """Sliding windows of samples per (model, version).

    Args:
        clock: Unix seconds (injectable for tests).
    """

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self._samples: dict[tuple[str, str], deque[Sample]] = {}

    def record(self, model: str, version: str, ok: bool, ttft_s: float | None = None) -> None:
        """Add one outcome."""
        if not version:
            return
        window = self._samples.setdefault((model, version), deque(maxlen=MAX_SAMPLES))
        window.append(Sample(self.clock(), ok, ttft_s))

    def summary(
        self, model: str, version: str, window_s: float, since: float = 0.0
    ) -> VersionSummary:
        """Outcomes newer than ``since`` and than ``window_s`` ago."""
        start = max(since, self.clock() - window_s)
        samples = [s for s in self._samples.get((model, version), ()) if s.at >= start]
        errors = sum(1 for s in samples if not s.ok)
        ttfts = [s.ttft_s for s in samples if s.ttft_s is not None]
        return VersionSummary(len(samples), errors, p95(ttfts))

    def forget(self, model: str, version: str) -> None:
        """Drop a version's samples."""
        self._samples.pop((model, version), None)
