"""bench.gatewaylib.report and .plot: the report's settings, its printed summary, its figure."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench.gatewaylib.limits import BENCH_LIMITS
from bench.gatewaylib.placement import CpuSplit
from bench.gatewaylib.plot import plot
from bench.gatewaylib.report import build_report, print_summary
from tests.unit.bench.fakes import bench_args


def test_the_report_holds_the_runs_settings_and_placement(
    fake_results: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("LLM_EAGER_SEND", raising=False)
    split = CpuSplit(engine={0}, proxy=None, rest={1, 2})
    report = build_report(bench_args(), split, 12, (0.5, 0.4, 0.3), fake_results)
    assert report["benchmark"] == "gateway_bench"
    assert (report["rounds"], report["prompt_tokens"], report["engine"]) == (2, 12, "stub")
    assert report["requests"] == {"c1": 3, "c32": 4}
    assert report["tenant_limits"] == str(BENCH_LIMITS).strip()
    assert report["stub_first_token_ms"] == 0.0
    # the proxies have no cores of their own: they run on the rest's
    assert report["placement"] == {"engine_cpus": [0], "proxy_cpus": [1, 2], "others_cpus": [1, 2]}
    assert report["results"] is fake_results
    shared = build_report(bench_args(unlimited_tenant=True, engine="model"), None, 1, (0, 0, 0), {})
    assert shared["placement"] == "every process on every core"
    assert shared["tenant_limits"] == "none"
    assert shared["stub_first_token_ms"] is None
    assert report["eager_send"] is True  # the services' default
    monkeypatch.setenv("LLM_EAGER_SEND", "0")  # the services inherit the bench's environment
    assert build_report(bench_args(), None, 1, (0, 0, 0), {})["eager_send"] is False


def test_the_summary_prints_each_concurrency_and_the_pairs(
    fake_results: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    print_summary(fake_results)
    out = capsys.readouterr().out
    assert out.startswith("c1 {")
    assert "\nc32 {" in out
    assert "  c32 proxy CPU ms per request (floor, work: the relays';" in out
    assert "    auth                               n=2 " in out
    assert "c1 paired (5 pairs), per-pair differences in ms:" in out
    assert "  gateway gRPC - engine, first token [gateway]: p1 2.00  p10 2.00  p50 2.00" in out


def test_plot_draws_the_report(fake_results: dict[str, Any], tmp_path: Path) -> None:
    split = CpuSplit(engine=None, proxy={3}, rest={0, 1, 2})
    report = build_report(bench_args(), split, 12, (0.5, 0.4, 0.3), fake_results)
    report["machine"]["loadavg_at_save"] = [0.5]
    path = tmp_path / "gateway_bench.png"
    plot(report, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
