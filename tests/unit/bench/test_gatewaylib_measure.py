"""bench.gatewaylib.measure: rounds, pairs and what the report makes of them."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from bench.gatewaylib.measure import limited
from bench.gatewaylib.sides import Sample
from tests.unit.bench.fakes import bench_args


def test_limited_keeps_at_most_concurrency_in_flight() -> None:
    live = peak = 0

    async def one() -> Sample:
        nonlocal live, peak
        live += 1
        peak = max(peak, live)
        await asyncio.sleep(0.001)
        live -= 1
        return 0.0, 0.0, 0.0, 0.0

    assert len(asyncio.run(limited(one, 10, 3))) == 10
    assert peak == 3


def test_measure_reports_each_side_and_the_round_and_pair_differences(
    fake_results: dict[str, Any], fake_sides: list[str]
) -> None:
    for conc in ("c1", "c32"):
        res = fake_results[conc]
        assert set(fake_sides) <= set(res)
        assert res["engine"]["ttft_p50_ms"] == pytest.approx(10.0)
        assert res["added"]["ttft_p50_ms"] == pytest.approx(2.0)  # gateway - engine
        assert res["floor_added"]["ttft_p50_ms"] == pytest.approx(1.0)
        assert res["gateway_vs_floor"]["ttft_p50_ms"] == pytest.approx(1.0)
        assert res["http_vs_grpc"]["first_text_p50_ms"] == pytest.approx(3.0)
        assert len(res["by_round"]["gateway"]) == bench_args().rounds
        # one observation per scrape: each run's before/after pair adds one, per round
        assert res["gateway_stages"]["auth"]["count"] == bench_args().rounds
    paired = fake_results["c1_paired"]
    assert paired["pairs"] == bench_args().pairs
    assert paired["gateway_minus_engine_ttft"]["gateway"]["p50_ms"] == pytest.approx(2.0)
    assert paired["gateway_minus_floor_ttft"]["gateway"]["p99_ms"] == pytest.approx(1.0)
    assert set(paired["front_minus_grpc_first_text"]) == set(fake_sides) - {
        "engine",
        "floor",
        "gateway",
    }


def test_no_pairs_skips_the_paired_figures(fake_sides: list[str]) -> None:
    from bench.gatewaylib.measure import measure

    got = measure(bench_args(pairs=0, rounds=1), {"gateway_metrics": "u"}, "sk", [1])
    assert "c1_paired" not in got
    assert set(got) == {"c1", "c32"}
