"""bench.gateway_bench's paired figures: per-pair differences, not differences of quantiles."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest

from bench.gateway_bench import paired_differences, round_differences, split_cpus


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


def test_stage_figures_are_what_a_run_added_to_the_gateway_histograms() -> None:
    from bench.gateway_bench import add_delta, histogram_quantile, stage_figures

    # cumulative buckets: before, 10 observations in (0, 1 ms]; the run adds 10 more,
    # all in (1, 2 ms] (1.5 ms each)
    before = {"auth": (10.0, 0.005, {0.001: 10.0, 0.002: 10.0, float("inf"): 10.0})}
    after = {"auth": (20.0, 0.02, {0.001: 10.0, 0.002: 20.0, float("inf"): 20.0})}
    d = stage_figures(add_delta({}, before, after))["auth"]
    assert d["count"] == 10
    assert abs(d["mean_ms"] - 1.5) < 1e-9
    assert 1.0 < d["p50_ms"] <= 2.0  # inside the bucket the run filled, not the old one
    assert math.isnan(histogram_quantile(0.5, {0.001: 0.0, float("inf"): 0.0}))  # none seen


def test_paired_differences_report_both_tails() -> None:
    # differences -5..+5 ms in 1 ms steps plus one +20 ms outlier: the low tail shows
    # that the spread is noise around the median, not the front's cost
    base = [(0.0, 0.0, 0.0, 0.0)] * 12
    other = [(d / 1000, 0.0, 0.0, 0.0) for d in (*range(-5, 6), 20)]
    got = paired_differences({"engine": base, "gateway": other}, "engine", 0)["gateway"]
    assert set(got) == {"p1_ms", "p10_ms", "p50_ms", "p90_ms", "p99_ms"}
    assert got["p1_ms"] < 0 < got["p99_ms"]
    assert got["p1_ms"] <= got["p10_ms"] <= got["p50_ms"] <= got["p90_ms"] <= got["p99_ms"]


def test_process_cpu_seconds_grows_with_work_and_is_nan_for_no_process() -> None:
    from bench.gateway_bench import process_cpu_seconds

    before = process_cpu_seconds(os.getpid())
    sum(i * i for i in range(2_000_000))  # some CPU time of this process
    assert process_cpu_seconds(os.getpid()) > before
    assert math.isnan(process_cpu_seconds(2**31 - 1))  # no such process
    assert math.isnan(process_cpu_seconds(None))  # a side with no proxy process


def test_summarize_divides_the_proxy_cpu_by_the_requests() -> None:
    from bench.gateway_bench import summarize

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


def test_split_cpus_gives_the_engine_the_first_cores_and_keeps_one_for_the_rest() -> None:
    mine = sorted(os.sched_getaffinity(0))
    assert split_cpus(0) is None
    assert split_cpus(0, 0) is None
    with pytest.raises(SystemExit, match="needs at least one left"):
        split_cpus(len(mine))
    with pytest.raises(SystemExit, match="needs at least one left"):
        split_cpus(0, len(mine))
    if len(mine) < 2:
        pytest.skip("one CPU: nothing to split")
    split = split_cpus(1)
    assert split is not None
    assert split.engine == {mine[0]}
    assert split.rest == set(mine[1:])
    assert split.proxy is None  # no cores of their own: the proxies run on the rest's
    split = split_cpus(0, 1)
    assert split is not None
    assert split.proxy == {mine[-1]}  # the proxies take the last core
    assert split.rest == set(mine[:-1])
    assert split.engine is None
    assert not split.proxy & split.rest
    if len(mine) >= 3:
        split = split_cpus(1, 1)
        assert split is not None
        assert (split.engine, split.proxy, split.rest) == ({mine[0]}, {mine[-1]}, set(mine[1:-1]))
    with pytest.raises(SystemExit, match="needs at least one left"):
        split_cpus(1, len(mine) - 1)


def test_process_cpu_seconds_counts_the_child_processes() -> None:
    """A gateway with workers is charged its workers' CPU: a busy child's seconds are in
    its parent's figure while it runs."""
    import time

    from bench.gateway_bench import process_cpu_seconds

    spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < 30: pass"
    child = subprocess.Popen([sys.executable, "-c", spin])
    try:
        deadline = time.monotonic() + 20
        while process_cpu_seconds(child.pid) < 0.5 and time.monotonic() < deadline:
            time.sleep(0.05)
        own_alone = time.process_time()  # this process, without its children
        child_cpu = process_cpu_seconds(child.pid)
        assert child_cpu >= 0.5
        assert process_cpu_seconds(os.getpid()) >= own_alone + child_cpu - 0.05
    finally:
        child.kill()
        child.wait()
