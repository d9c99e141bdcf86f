"""Engine-lifetime totals are exported as Prometheus counters, levels as gauges."""

from __future__ import annotations

import dataclasses

from prometheus_client import CollectorRegistry, generate_latest

from engine_svc.core.outputs import EngineStats
from engine_svc.metrics import StatsCollector
from engine_svc.stats import BackendStats


def test_totals_are_counters_and_levels_are_gauges() -> None:
    zero = {
        f.name: 0
        for f in dataclasses.fields(EngineStats)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    }
    stats = dataclasses.replace(
        EngineStats(**zero), num_preemptions_total=7, num_running=3, prefix_cache_hits=5
    )
    registry = CollectorRegistry()
    registry.register(StatsCollector(lambda: BackendStats(stats, 0.0, 12.5)))
    text = generate_latest(registry).decode()
    types = {
        line.split()[2].removesuffix("_total"): line.split()[3]
        for line in text.splitlines()
        if line.startswith("# TYPE ")
    }
    assert types["engine_num_preemptions"] == "counter"
    assert types["engine_prefix_cache_hits"] == "counter"
    assert types["engine_prefix_cache_queries"] == "counter"
    assert types["engine_num_requests_running"] == "gauge"
    assert types["engine_generation_tokens_per_second"] == "gauge"
    assert "engine_num_preemptions_total 7.0" in text
    assert "engine_prefix_cache_hits_total 5.0" in text
    assert "engine_num_requests_running 3.0" in text
