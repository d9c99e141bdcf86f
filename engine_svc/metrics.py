"""Prometheus metrics of an engine replica (vLLM's names, with an ``engine_`` prefix).

Histograms and counters are recorded by the servicer as requests finish;
gauges are read from the backend's stats snapshot at scrape time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import Counter, Histogram, Info
from prometheus_client.core import REGISTRY, CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from engine_svc.backends.base import BackendStats
from engine_svc.core.outputs import RequestOutput, StepTimings

PRIORITY_NAMES = {0: "NORMAL", 1: "LOW", 2: "NORMAL", 3: "CRITICAL"}
_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_TPOT = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1)

TTFT = Histogram("engine_time_to_first_token_seconds", "Arrival to first token",
                 ["priority"], buckets=_LATENCY)
TPOT = Histogram("engine_time_per_output_token_seconds", "Mean time per output token after "
                 "the first, per request", ["priority"], buckets=_TPOT)
E2E = Histogram("engine_e2e_request_latency_seconds", "Arrival to finish",
                ["priority"], buckets=_LATENCY)
QUEUE = Histogram("engine_request_queue_time_seconds", "Arrival to first scheduled",
                  ["priority"], buckets=_LATENCY)
PROMPT_TOKENS = Counter("engine_prompt_tokens", "Prompt tokens of finished requests")
GENERATION_TOKENS = Counter("engine_generation_tokens", "Generated tokens of finished requests")
SUCCESS = Counter("engine_request_success", "Finished requests", ["finished_reason"])
ERRORS = Counter("engine_request_errors", "Requests rejected or failed", ["error_type"])
_STEP = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)
STEP_PHASE = Histogram("engine_step_phase_seconds", "Time of one engine step in each phase "
                       "(schedule, prepare, forward, sample, update)", ["phase"], buckets=_STEP)
STEP_BATCH = Histogram("engine_step_num_decodes", "Decoding sequences per engine step",
                       buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256))
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
            ("engine_generation_tokens_per_second", "Recent generation throughput",
             s.generation_tokens_per_second),
        ):
            yield GaugeMetricFamily(name, doc, value=value)
        for name, doc, value in (  # exposed as <name>_total
            ("engine_num_preemptions", "Preemptions since start", e.num_preemptions_total),
            ("engine_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
             e.prefix_cache_queries),
            ("engine_prefix_cache_hits", "Prompt tokens found in the prefix cache",
             e.prefix_cache_hits),
            ("engine_prefix_cache_evictions", "Cached blocks evicted for reuse",
             e.prefix_cache_evictions),
            ("engine_spec_decode_num_draft_tokens", "Speculative tokens proposed",
             e.num_draft_tokens_total),
            ("engine_spec_decode_num_accepted_tokens",
             "Speculative tokens accepted (= forward passes saved)",
             e.num_accepted_tokens_total),
        ):
            yield CounterMetricFamily(name, doc, value=value)


def register_stats(stats: Callable[[], BackendStats]) -> StatsCollector:
    collector = StatsCollector(stats)
    REGISTRY.register(collector)
    return collector
