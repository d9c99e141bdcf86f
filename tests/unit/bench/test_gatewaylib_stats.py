"""bench.gatewaylib.stats: per-pair differences, not differences of quantiles."""

from __future__ import annotations

import math

import pytest

from bench.gatewaylib.stats import (
    paired_differences,
    per_rank_ms,
    round_differences,
    summarize,
)


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


def test_paired_differences_report_both_tails() -> None:
    # differences -5..+5 ms in 1 ms steps plus one +20 ms outlier: the low tail shows
    # that the spread is noise around the median, not the front's cost
    base = [(0.0, 0.0, 0.0, 0.0)] * 12
    other = [(d / 1000, 0.0, 0.0, 0.0) for d in (*range(-5, 6), 20)]
    got = paired_differences({"engine": base, "gateway": other}, "engine", 0)["gateway"]
    assert set(got) == {"p1_ms", "p10_ms", "p50_ms", "p90_ms", "p99_ms"}
    assert got["p1_ms"] < 0 < got["p99_ms"]
    assert got["p1_ms"] <= got["p10_ms"] <= got["p50_ms"] <= got["p90_ms"] <= got["p99_ms"]


def test_summarize_divides_the_proxy_cpu_by_the_requests() -> None:
    rows = [(0.010, 0.001, 0.001, 0.010)] * 4
    assert abs(summarize(rows, 0.008)["proxy_cpu_ms_per_request"] - 2.0) < 1e-9
    assert math.isnan(summarize(rows)["proxy_cpu_ms_per_request"])


def test_round_differences_take_the_median_of_each_rounds_difference() -> None:
    """Two rounds of three the gateway is 5 ms behind; in one the engine's next step
    splits the sides. The median of differences says 5; the difference of the sides'
    medians says the gateway is 295 ms faster."""
    engine = [{"ttft": 100.0}, {"ttft": 400.0}, {"ttft": 400.0}]
    gateway = [{"ttft": 105.0}, {"ttft": 105.0}, {"ttft": 405.0}]
    assert round_differences(gateway, engine) == {"ttft": 5.0}
    two = [{"a": 1.0, "b": 2.0}]
    assert round_differences(two, [{"a": 0.5, "b": 0.0}], ("a",)) == {"a": 0.5}


def test_the_per_rank_slope_is_each_further_request_of_a_burst_later() -> None:
    """A burst whose first tokens come 2 ms apart, in any order, has a slope of 2 ms;
    TTFTs that do not queue have none; one request has no slope."""
    assert per_rank_ms([16.0, 10.0, 14.0, 12.0]) == pytest.approx(2.0)
    assert per_rank_ms([5.0, 5.0, 5.0]) == pytest.approx(0.0)
    assert math.isnan(per_rank_ms([5.0]))
    rows = [(t / 1000, 0.001, 0.001, t / 1000) for t in (30.0, 10.0, 20.0)]
    assert summarize(rows)["ttft_per_rank_ms"] == pytest.approx(10.0)
