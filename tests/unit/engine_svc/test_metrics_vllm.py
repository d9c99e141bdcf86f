"""vLLM's series as vLLM exports them: names, types, buckets and labels; the series
vLLM removed are not exported, and no gauge's name ends in a counter's ``_total``."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from engine_svc import metrics
from engine_svc.core.outputs import EngineStats, RequestOutput, StepTimings
from engine_svc.core.request import FinishReason
from engine_svc.stats import BackendStats


def _stats() -> BackendStats:
    zero = {
        f.name: 0
        for f in dataclasses.fields(EngineStats)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    }
    return BackendStats(dataclasses.replace(EngineStats(**zero), num_kv_blocks_total=64))


class _Engine(Collector):
    def collect(self) -> Iterator[Metric]:
        return iter(metrics.ENGINE.collect())


def _scrape(max_model_len: int = 2048) -> tuple[str, dict[str, str]]:
    """One request's life through the metric hooks, then the exposition text and
    each family's type."""
    series = metrics.VllmSeries(max_model_len)
    saved = metrics._vllm[0]
    metrics._vllm[0] = series
    try:
        source = CollectorRegistry()
        source.register(metrics.StatsCollector(_stats))
        source.register(_Engine())  # the process's counters and histograms
        metrics.observe_outputs([RequestOutput("r", [5])], now=10.0)
        metrics.observe_outputs([RequestOutput("r", [6, 7])], now=10.25)
        metrics.observe_outputs([RequestOutput("r", [8])], now=10.5)
        done = RequestOutput(
            "r",
            [],
            finished=True,
            finish_reason=FinishReason.LENGTH,
            num_prompt_tokens=30,
            num_cached_tokens=16,
            num_output_tokens=4,
            arrival_time=9.0,
            first_scheduled_time=9.5,
            first_token_time=10.0,
            finished_time=10.5,
        )
        metrics.observe_outputs([done], now=10.5)
        metrics.observe_finished(done, priority=0)
        metrics.observe_step(StepTimings(num_decodes=3, num_prefill_tokens=9))
        registry = CollectorRegistry()
        registry.register(metrics.ExportCollector("smol", source=source, vllm=series.registry))
        text = generate_latest(registry).decode()
    finally:
        metrics._vllm[0] = saved
    types = {f.name: f.type for f in text_string_to_metric_families(text)}
    return text, types


def _buckets(text: str, name: str) -> list[float]:
    return [
        float(s.labels["le"])
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == f"{name}_bucket" and s.labels["le"] != "+Inf"
    ]


def _value(text: str, sample: str) -> float:
    return next(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == sample and s.labels.get("le") in (None, "+Inf")
    )


def test_vllm_histograms_have_vllms_buckets_and_labels() -> None:
    text, types = _scrape(max_model_len=2048)
    assert types["vllm:time_to_first_token_seconds"] == "histogram"
    ttft = _buckets(text, "vllm:time_to_first_token_seconds")
    assert ttft[:3] == [0.001, 0.005, 0.01]
    assert ttft[-1] == 2560.0
    assert len(ttft) == 22
    e2e = _buckets(text, "vllm:e2e_request_latency_seconds")
    assert e2e[0] == 0.3
    assert e2e[-1] == 7680.0
    assert len(e2e) == 21
    assert _buckets(text, "vllm:request_prefill_time_seconds") == e2e
    itl = _buckets(text, "vllm:inter_token_latency_seconds")
    assert itl[0] == 0.01
    assert itl[-1] == 80.0
    assert len(itl) == 19
    # token counts: 1-2-5 up to max_model_len
    assert _buckets(text, "vllm:request_prompt_tokens")[-3:] == [500, 1000, 2000]
    assert types["vllm:iteration_tokens_total"] == "histogram"
    assert _buckets(text, "vllm:iteration_tokens_total")[-1] == 16384
    for line in text.splitlines():
        if line.startswith("vllm:"):
            assert 'model_name="smol"' in line, line
            assert 'engine="0"' in line, line


def test_one_requests_phases_and_token_counts() -> None:
    text, _ = _scrape()
    assert _value(text, "vllm:request_queue_time_seconds_sum") == 0.5
    assert _value(text, "vllm:request_prefill_time_seconds_sum") == 0.5
    assert _value(text, "vllm:request_decode_time_seconds_sum") == 0.5
    assert _value(text, "vllm:request_inference_time_seconds_sum") == 1.0
    assert _value(text, "vllm:e2e_request_latency_seconds_sum") == 1.5
    assert _value(text, "vllm:request_time_per_output_token_seconds_sum") == 0.5 / 3
    # two gaps after the first token: 0.25 s each; the final output carried no token
    assert _value(text, "vllm:inter_token_latency_seconds_count") == 2
    assert _value(text, "vllm:inter_token_latency_seconds_sum") == 0.5
    assert _value(text, "vllm:request_prompt_tokens_sum") == 30
    assert _value(text, "vllm:request_generation_tokens_sum") == 4
    assert _value(text, "vllm:request_prefill_kv_computed_tokens_sum") == 14
    assert _value(text, "vllm:iteration_tokens_total_sum") == 12


def test_counters_and_gauges_under_vllms_names() -> None:
    text, types = _scrape()
    assert types["vllm:num_requests_running"] == "gauge"
    assert types["vllm:kv_cache_usage_perc"] == "gauge"
    for name in ("vllm:prompt_tokens", "vllm:generation_tokens", "vllm:request_success"):
        assert types[name] == "counter", name
    assert 'vllm:request_success_total{engine="0",finished_reason="length"' in text
    assert "# TYPE vllm:prefix_cache_hits_total counter" in text


def test_removed_and_misnamed_series_are_gone() -> None:
    text, types = _scrape()
    # vLLM removed it (its per-request replacement is request_time_per_output_token)
    assert "vllm:time_per_output_token_seconds" not in types
    gauges = [n for n, t in types.items() if t == "gauge"]
    assert "engine_num_kv_blocks" in gauges
    assert not [n for n in gauges if n.endswith("_total")]
    assert "engine_num_kv_blocks 64.0" in text.replace('{model_name="smol"}', "")
