"""bench.gateway_bench's paired figures: per-pair differences, not differences of quantiles."""

from __future__ import annotations

from bench.gateway_bench import paired_differences, pct


def test_paired_differences_subtract_pair_by_pair() -> None:
    # the base side drifts (a noisy machine); the other side is always 2 ms behind it
    base = [(t, 0.0, 0.0, t + 0.001) for t in (0.010, 0.050, 0.020, 0.090, 0.030)]
    slow = [(t + 0.002, 0.0, 0.0, t + 0.004) for t, *_ in base]
    got = paired_differences({"engine": base, "gateway": slow}, "engine", 0)
    assert set(got) == {"gateway"}
    assert all(abs(v - 2.0) < 1e-9 for v in got["gateway"].values())
    # field 3 (first text event) differs by 3 ms in every pair
    assert (
        abs(
            paired_differences({"engine": base, "gateway": slow}, "engine", 3)["gateway"]["p50_ms"]
            - 3.0
        )
        < 1e-9
    )


def test_pct_is_nearest_rank() -> None:
    assert pct([5.0, 1.0, 3.0], 0.5) == 3.0
    assert pct([5.0, 1.0, 3.0], 0.99) == 5.0
    assert pct([5.0, 1.0, 3.0], 0.0) == 1.0
