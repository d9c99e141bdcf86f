"""Prometheus metrics of an engine replica (vLLM's names, with an ``engine_`` prefix).

Histograms and counters are recorded by the servicer as requests finish;
gauges are read from the backend's stats snapshot at scrape time. Every series
carries ``model_name`` and is exported twice: as ``engine_*`` and, for the ones
vLLM has, under vLLM's own names (``vllm:*``), so dashboards and alert rules
written for vLLM work unchanged against this engine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, Info
from prometheus_client.core import REGISTRY, CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from engine_svc.core.outputs import RequestOutput, StepTimings
from engine_svc.stats import BackendStats

PRIORITY_NAMES = {0: "NORMAL", 1: "LOW", 2: "NORMAL", 3: "CRITICAL"}
# the engine's own series, exported by ExportCollector with model_name (and vLLM's names)
ENGINE = CollectorRegistry(auto_describe=True)
_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_TPOT = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1)
_STEP = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)

TTFT = Histogram(
    "engine_time_to_first_token_seconds",
    "Arrival to first token",
    ["priority"],
    buckets=_LATENCY,
    registry=ENGINE,
)
TPOT = Histogram(
    "engine_time_per_output_token_seconds",
    "Mean time per output token after the first, per request",
    ["priority"],
    buckets=_TPOT,
    registry=ENGINE,
)
E2E = Histogram(
    "engine_e2e_request_latency_seconds",
    "Arrival to finish",
    ["priority"],
    buckets=_LATENCY,
    registry=ENGINE,
)
QUEUE = Histogram(
    "engine_request_queue_time_seconds",
    "Arrival to first scheduled",
    ["priority"],
    buckets=_LATENCY,
    registry=ENGINE,
)
PROMPT_TOKENS = Counter(
    "engine_prompt_tokens", "Prompt tokens of finished requests", registry=ENGINE
)
GENERATION_TOKENS = Counter(
    "engine_generation_tokens", "Generated tokens of finished requests", registry=ENGINE
)
SUCCESS = Counter(
    "engine_request_success", "Finished requests", ["finished_reason"], registry=ENGINE
)
ERRORS = Counter(
    "engine_request_errors", "Requests rejected or failed", ["error_type"], registry=ENGINE
)
STEP_PHASE = Histogram(
    "engine_step_phase_seconds",
    "Time of one engine step in each phase (schedule, prepare, forward, sample, update)",
    ["phase"],
    buckets=_STEP,
    registry=ENGINE,
)
STEP_BATCH = Histogram(
    "engine_step_num_decodes",
    "Decoding sequences per engine step",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
    registry=ENGINE,
)
MODEL = Info("engine_model", "The served model, its version and the engine build/config")


def observe_step(timings: StepTimings) -> None:
    """Record where one engine step's time went (called from the step-loop thread)."""
    for phase, seconds in timings.phases().items():
        STEP_PHASE.labels(phase).observe(seconds)
    if timings.num_decodes:
        STEP_BATCH.observe(timings.num_decodes)


def observe_finished(out: RequestOutput, priority: int) -> None:
    """Record one finished request's latencies and token counts."""
    label = PRIORITY_NAMES.get(priority, "NORMAL")
    if out.first_scheduled_time is not None:
        QUEUE.labels(label).observe(out.first_scheduled_time - out.arrival_time)
    if out.first_token_time is not None:
        TTFT.labels(label).observe(out.first_token_time - out.arrival_time)
        generated = out.num_output_tokens - out.num_resumed_tokens
        if out.finished_time is not None and generated > 1:
            TPOT.labels(label).observe((out.finished_time - out.first_token_time) / (generated - 1))
    if out.finished_time is not None:
        E2E.labels(label).observe(out.finished_time - out.arrival_time)
    PROMPT_TOKENS.inc(out.num_prompt_tokens)
    GENERATION_TOKENS.inc(max(0, out.num_output_tokens - out.num_resumed_tokens))
    SUCCESS.labels(str(out.finish_reason or "error")).inc()


class StatsCollector(Collector):
    """Gauges and engine-lifetime counters from the backend's latest snapshot; the
    counters are exported as counters (``rate()`` and resets work as Prometheus
    expects), the gauges as gauges."""

    def __init__(self, stats: Callable[[], BackendStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        try:
            s = self._stats()
        except AssertionError:  # not started yet
            return
        e = s.engine
        for name, doc, value in (
            ("engine_num_requests_running", "Requests in the running batch", e.num_running),
            ("engine_num_requests_waiting", "Requests waiting to be scheduled", e.num_waiting),
            ("engine_kv_cache_usage_perc", "Share of KV blocks in use (0-1)", e.kv_cache_usage),
            ("engine_num_kv_blocks_total", "KV blocks in the pool", e.num_kv_blocks_total),
            (
                "engine_fair_share_tenants",
                "Tenants with live requests, whose fair-share counters are kept",
                e.num_fair_share_tenants,
            ),
            (
                "engine_generation_tokens_per_second",
                "Recent generation throughput",
                s.generation_tokens_per_second,
            ),
        ):
            yield GaugeMetricFamily(name, doc, value=value)
        for name, doc, value in (  # exposed as <name>_total
            ("engine_num_preemptions", "Preemptions since start", e.num_preemptions_total),
            (
                "engine_step_interrupts",
                "Steps run between two layers of a step in flight, for a request that "
                "outranked its prompts",
                e.num_step_interrupts_total,
            ),
            (
                "engine_prefix_cache_queries",
                "Prompt tokens looked up in the prefix cache",
                e.prefix_cache_queries,
            ),
            (
                "engine_prefix_cache_hits",
                "Prompt tokens found in the prefix cache",
                e.prefix_cache_hits,
            ),
            (
                "engine_prefix_cache_evictions",
                "Cached blocks evicted for reuse",
                e.prefix_cache_evictions,
            ),
            (
                "engine_spec_decode_num_draft_tokens",
                "Speculative tokens proposed",
                e.num_draft_tokens_total,
            ),
            (
                "engine_spec_decode_num_accepted_tokens",
                "Speculative tokens accepted (= forward passes saved)",
                e.num_accepted_tokens_total,
            ),
        ):
            yield CounterMetricFamily(name, doc, value=value)


def register_stats(stats: Callable[[], BackendStats]) -> StatsCollector:
    collector = StatsCollector(stats)
    ENGINE.register(collector)
    return collector


# engine_* family -> vLLM's name for the same series
VLLM_NAMES = {
    "engine_num_requests_running": "vllm:num_requests_running",
    "engine_num_requests_waiting": "vllm:num_requests_waiting",
    "engine_kv_cache_usage_perc": "vllm:kv_cache_usage_perc",
    "engine_num_preemptions": "vllm:num_preemptions",
    "engine_prompt_tokens": "vllm:prompt_tokens",
    "engine_generation_tokens": "vllm:generation_tokens",
    "engine_request_success": "vllm:request_success",
    "engine_time_to_first_token_seconds": "vllm:time_to_first_token_seconds",
    "engine_time_per_output_token_seconds": "vllm:time_per_output_token_seconds",
    "engine_e2e_request_latency_seconds": "vllm:e2e_request_latency_seconds",
    "engine_request_queue_time_seconds": "vllm:request_queue_time_seconds",
    "engine_prefix_cache_queries": "vllm:prefix_cache_queries",
    "engine_prefix_cache_hits": "vllm:prefix_cache_hits",
}


def _relabelled(family: Metric, name: str, model_name: str) -> Metric:
    out = Metric(name, family.documentation, family.type, family.unit)
    for sample in family.samples:
        out.add_sample(
            name + sample.name[len(family.name) :],
            {**sample.labels, "model_name": model_name},
            sample.value,
            sample.timestamp,
            sample.exemplar,
        )
    return out


class ExportCollector(Collector):
    """The engine's series with ``model_name``, under their names and vLLM's."""

    def __init__(self, model_name: str, source: CollectorRegistry = ENGINE) -> None:
        self.model_name, self.source = model_name, source

    def collect(self) -> Iterator[Metric]:
        for family in self.source.collect():
            yield _relabelled(family, family.name, self.model_name)
            if family.name in VLLM_NAMES:
                yield _relabelled(family, VLLM_NAMES[family.name], self.model_name)


def export(model_name: str) -> ExportCollector:
    """Publish the engine's series (with ``model_name``) on the process's /metrics."""
    collector = ExportCollector(model_name)
    REGISTRY.register(collector)
    return collector
