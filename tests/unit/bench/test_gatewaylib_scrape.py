"""bench.gatewaylib.scrape: what a run added to the gateway's own histograms."""

from __future__ import annotations

import math

from bench.gatewaylib.scrape import add_delta, histogram_quantile, parse_histograms, stage_figures


def test_stage_figures_are_what_a_run_added_to_the_gateway_histograms() -> None:
    # cumulative buckets: before, 10 observations in (0, 1 ms]; the run adds 10 more,
    # all in (1, 2 ms] (1.5 ms each)
    before = {"auth": (10.0, 0.005, {0.001: 10.0, 0.002: 10.0, float("inf"): 10.0})}
    after = {"auth": (20.0, 0.02, {0.001: 10.0, 0.002: 20.0, float("inf"): 20.0})}
    d = stage_figures(add_delta({}, before, after))["auth"]
    assert d["count"] == 10
    assert abs(d["mean_ms"] - 1.5) < 1e-9
    assert 1.0 < d["p50_ms"] <= 2.0  # inside the bucket the run filled, not the old one
    assert math.isnan(histogram_quantile(0.5, {0.001: 0.0, float("inf"): 0.0}))  # none seen


def test_parse_histograms_picks_each_stage_by_its_label_and_sums_the_rest() -> None:
    """A page as the gateway serves it: the stage series by their ``stage`` label, a
    histogram without labels summed whole, a series the page lacks counted as nothing."""
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    reg = CollectorRegistry()
    stage = Histogram("gateway_stage_seconds", "", ["stage"], buckets=(0.001, 0.01), registry=reg)
    overhead = Histogram(
        "gateway_overhead_seconds", "", ["worker"], buckets=(0.001, 0.01), registry=reg
    )
    stage.labels("auth").observe(0.0005)
    stage.labels("auth").observe(0.005)
    stage.labels("encode").observe(0.002)
    overhead.labels("0").observe(0.004)
    overhead.labels("1").observe(0.006)
    got = parse_histograms(generate_latest(reg).decode())
    count, total, buckets = got["auth"]
    assert (count, buckets) == (2.0, {0.001: 1.0, 0.01: 2.0, math.inf: 2.0})
    assert abs(total - 0.0055) < 1e-12
    assert got["encode"][0] == 1.0
    assert got["route"] == (0.0, 0.0, {})  # never observed: no series on the page
    assert got["overhead (to the engine attempt)"][0] == 2.0  # both workers' series
    assert got["ttft (gateway's view)"] == (0.0, 0.0, {})  # no such family


def test_the_overlapped_reservation_is_read_under_the_gateways_label() -> None:
    """The gateway labels the reservation that overlaps the engine's start
    ``reserve_overlap`` (gateway.metrics.STAGE_RESERVE_OVERLAP); the report says so too."""
    from prometheus_client import CollectorRegistry, generate_latest

    from gateway import metrics

    reg = CollectorRegistry()
    reg.register(metrics.STAGE)
    try:
        before = parse_histograms(generate_latest(reg).decode())["reserve_overlap"][0]
        metrics.STAGE_RESERVE_OVERLAP.observe(0.002)
        after = parse_histograms(generate_latest(reg).decode())["reserve_overlap"][0]
    finally:
        reg.unregister(metrics.STAGE)
    assert after == before + 1
    assert "reserve_beside" not in stage_figures(parse_histograms(""))
