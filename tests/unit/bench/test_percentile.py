"""The benches' one percentile (bench.loadlib.stats.percentile) against the definitions it
replaced: gateway_bench's nearest rank round(q * (n - 1)) and ratelimit_bench's
int(q * n)."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from bench.loadlib.stats import percentile

QS = (1, 10, 50, 90, 99)


def old_gateway_pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def old_ratelimit_pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def test_known_values_interpolate_between_order_statistics() -> None:
    xs = [5.0, 1.0, 3.0]  # sorted: 1, 3, 5
    assert percentile(xs, 0) == 1.0
    assert percentile(xs, 50) == 3.0
    assert percentile(xs, 75) == 4.0
    assert percentile(xs, 99) == pytest.approx(4.96)
    assert percentile(xs, 100) == 5.0
    assert percentile([2.0, 4.0], 50) == 3.0  # an even count: between the middle two
    assert math.isnan(percentile([], 50))
    assert math.isnan(percentile([math.nan], 99))  # curl's gaps: none measured


def test_it_is_numpys_default() -> None:
    rng = random.Random(7)
    for n in (1, 2, 16, 64, 100, 1001):
        xs = [rng.expovariate(1.0) for _ in range(n)]
        for q in (*QS, 95):
            assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)), abs=1e-12)


def test_the_replaced_definitions_agree_where_the_rank_is_whole() -> None:
    """With 101 values every percentile the benches report falls on a whole rank
    (q * (n - 1) and int(q * n) name the same order statistic), and all three agree."""
    rng = random.Random(3)
    xs = [rng.gauss(0.0, 1.0) for _ in range(101)]
    for q in QS:
        want = percentile(xs, q)
        assert old_gateway_pct(xs, q / 100) == pytest.approx(want, abs=1e-12)
        assert old_ratelimit_pct(xs, q / 100) == pytest.approx(want, abs=1e-12)


def test_elsewhere_they_differ_by_less_than_one_neighbouring_gap() -> None:
    """Between whole ranks the nearest-rank definitions pick a neighbouring order
    statistic; the interpolated value lies within one gap of it (sub-rank, noise)."""
    rng = random.Random(5)
    for n in (16, 64, 100, 2000):
        xs = sorted(rng.expovariate(1.0) for _ in range(n))
        for q in QS:
            i = int((n - 1) * q / 100)  # the order statistics either side of the rank
            lo, hi = xs[i], xs[min(n - 1, i + 1)]
            assert lo <= percentile(xs, q) <= hi
            for old in (old_gateway_pct(xs, q / 100), old_ratelimit_pct(xs, q / 100)):
                assert old in (lo, hi)
