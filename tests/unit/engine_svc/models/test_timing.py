"""compare_ms: interleaved rounds, best of each, untimed preparation (fake clock)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from engine_svc.models.timing import compare_ms
from tests.support.clock import FakeClock


class WorkClock(FakeClock):
    """Seconds that advance only when work 'runs'; a burst window adds load."""

    def __init__(self) -> None:
        super().__init__()
        self.burst: tuple[float, float] | None = None  # (start, end) of extra load

    def work(self, cost: float) -> Callable[[], None]:
        def run() -> None:
            slow = self.burst is not None and self.burst[0] <= self.now < self.burst[1]
            self.advance(cost * (10.0 if slow else 1.0))

        return run


def test_rounds_interleave_and_rotate() -> None:
    order: list[str] = []
    clock = WorkClock()
    runs = {n: (lambda n=n: order.append(n)) for n in "abc"}
    compare_ms(runs, rounds=3, warmup=2, clock=clock)
    assert order == list("aabbcc") + list("abc") + list("bca") + list("cab")


def test_a_burst_of_load_cannot_make_the_slower_candidate_win() -> None:
    clock = WorkClock()
    fast, slow = clock.work(2.0), clock.work(3.0)
    # load arrives during the first timed rounds: run one after the other, the fast
    # candidate would be timed entirely inside it and the slow one outside
    clock.burst = (4 * 2.5, 4 * 2.5 + 3 * 20.0)
    ms = compare_ms({"fast": fast, "slow": slow}, rounds=6, clock=clock)
    assert ms["fast"] == pytest.approx(2000.0)
    assert ms["slow"] == pytest.approx(3000.0)
    assert min(ms, key=lambda n: ms[n]) == "fast"


def test_prepare_runs_before_every_run_and_is_not_timed() -> None:
    clock = WorkClock()
    prepared: list[str] = []

    def prepare(name: str) -> None:
        prepared.append(name)
        clock.now += 100.0  # switching configuration is expensive, and not counted

    ms = compare_ms(
        {"x": clock.work(1.0), "y": clock.work(0.5)}, rounds=2, warmup=1, prepare=prepare,
        clock=clock,
    )  # fmt: skip
    assert prepared == ["x", "y", "x", "y", "y", "x"]
    assert ms == {"x": pytest.approx(1000.0), "y": pytest.approx(500.0)}


def test_rounds_must_be_positive() -> None:
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        compare_ms({"a": lambda: None}, rounds=0)
