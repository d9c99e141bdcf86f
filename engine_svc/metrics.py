"""Prometheus metrics of an engine replica: the engine's own ``engine_*`` series and
vLLM's ``vllm:*`` series, so dashboards and alert rules written for vLLM work unchanged.

Histograms and counters are recorded by the servicer as requests finish (and by the
step thread as tokens come out); gauges are read from the backend's stats snapshot at
scrape time. Every series carries ``model_name``; the ``vllm:*`` ones also carry
``engine`` ("0": one engine core per process), as vLLM's do. vLLM's series keep vLLM's
names, types and bucket boundaries (its ``vllm/v1/metrics``): its histograms are their
own instruments here (``VllmSeries``), its counters and gauges are the ``engine_*``
ones exported a second time under vLLM's name (``VLLM_NAMES``).
"""

from __future__ import annotations

import threading
import time
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
PROMPT_TOKENS_CACHED = Counter(
    "engine_prompt_tokens_cached",
    "Prompt tokens of finished requests served from the prefix cache",
    registry=ENGINE,
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

# vLLM's bucket boundaries (vllm/v1/metrics/buckets.py), by family
VLLM_REQUEST_LATENCY = (
    *(0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0),
    *(120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0),
)
VLLM_TIME_TO_FIRST_TOKEN = (
    *(0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0),
    *(7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0),
)
VLLM_INTER_TOKEN_LATENCY = (
    *(0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0),
    *(7.5, 10.0, 20.0, 40.0, 80.0),
)
VLLM_ITERATION_TOKENS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
VLLM_REQUEST_PARAMS_N = (1, 2, 5, 10, 20)
VLLM_REQUEST_NUM_PREEMPTIONS = (1, 2, 3, 4, 5, 10, 20)
VLLM_ENGINE_INDEX = "0"  # vLLM's ``engine`` label: one engine core per process here


def request_tokens_buckets(max_model_len: int) -> list[float]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to ``max_model_len``."""
    out: list[float] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_model_len:
                return out
            out.append(mantissa * scale)
        scale *= 10


def observe_step(timings: StepTimings) -> None:
    """Record where one engine step's time went (called from the step-loop thread)."""
    for phase, seconds in timings.phases().items():
        STEP_PHASE.labels(phase).observe(seconds)
    if timings.num_decodes:
        STEP_BATCH.observe(timings.num_decodes)
    series = _vllm[0]
    tokens = timings.num_prefill_tokens + timings.num_decodes
    if series is not None and tokens:
        series.iteration_tokens.observe(tokens)


def observe_finished(out: RequestOutput, priority: int) -> None:
    """Record one finished request's latencies and token counts."""
    label = PRIORITY_NAMES.get(priority, "NORMAL")
    if out.first_scheduled_time is not None:
        QUEUE.labels(label).observe(out.first_scheduled_time - out.arrival_time)
    generated = max(0, out.num_output_tokens - out.num_resumed_tokens)
    if out.first_token_time is not None:
        TTFT.labels(label).observe(out.first_token_time - out.arrival_time)
        if out.finished_time is not None and generated > 1:
            TPOT.labels(label).observe((out.finished_time - out.first_token_time) / (generated - 1))
    if out.finished_time is not None:
        E2E.labels(label).observe(out.finished_time - out.arrival_time)
    PROMPT_TOKENS.inc(out.num_prompt_tokens)
    PROMPT_TOKENS_CACHED.inc(out.num_cached_tokens)
    GENERATION_TOKENS.inc(generated)
    SUCCESS.labels(str(out.finish_reason or "error")).inc()
    series = _vllm[0]
    if series is not None:
        series.observe_finished(out, generated)


def observe_outputs(outputs: list[RequestOutput], now: float | None = None) -> None:
    """Note when each request's tokens came out (the step thread, as it hands outputs
    on): the gap since a request's previous tokens is one inter-token latency."""
    series = _vllm[0]
    if series is not None:
        series.tokens_out(outputs, time.monotonic() if now is None else now)


class VllmSeries:
    """vLLM's histograms (names, meanings and buckets as vLLM defines them), unlabelled
    here: ``ExportCollector`` adds ``model_name`` and ``engine``.

    Phases of a finished request, on the engine's clock: queue = arrival to first
    scheduled; prefill = first scheduled to first token; decode = first token to
    finish; inference = prefill + decode; time per output token = decode over the
    tokens after the first.
    """

    # bounds the inter-token clock's memory if a request never reports its end
    MAX_TRACKED = 100_000

    def __init__(self, max_model_len: int) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        tokens = request_tokens_buckets(max(1, max_model_len))

        def hist(name: str, doc: str, buckets: tuple[float, ...] | list[float]) -> Histogram:
            return Histogram(name, doc, buckets=buckets, registry=self.registry)

        self.ttft = hist(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            VLLM_TIME_TO_FIRST_TOKEN,
        )
        self.itl = hist(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            VLLM_INTER_TOKEN_LATENCY,
        )
        self.tpot = hist(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            VLLM_INTER_TOKEN_LATENCY,
        )
        phases = {
            "e2e": ("vllm:e2e_request_latency_seconds", "e2e request latency"),
            "queue": ("vllm:request_queue_time_seconds", "time spent in WAITING phase"),
            "inference": ("vllm:request_inference_time_seconds", "time spent in RUNNING phase"),
            "prefill": ("vllm:request_prefill_time_seconds", "time spent in PREFILL phase"),
            "decode": ("vllm:request_decode_time_seconds", "time spent in DECODE phase"),
        }
        self.phase = {
            key: hist(name, f"Histogram of {what} in seconds.", VLLM_REQUEST_LATENCY)
            for key, (name, what) in phases.items()
        }
        counts = {
            "prompt": ("vllm:request_prompt_tokens", "Number of prefill tokens processed."),
            "generation": (
                "vllm:request_generation_tokens",
                "Number of generation tokens processed.",
            ),
            "max_generation": (
                "vllm:request_max_num_generation_tokens",
                "Histogram of maximum number of requested generation tokens.",
            ),
            "prefill_kv": (
                "vllm:request_prefill_kv_computed_tokens",
                "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
            ),
        }
        self.count = {key: hist(name, doc, tokens) for key, (name, doc) in counts.items()}
        self.params_n = hist(
            "vllm:request_params_n", "Histogram of the n request parameter.", VLLM_REQUEST_PARAMS_N
        )
        self.preemptions = hist(
            "vllm:request_num_preemptions",
            "Histogram of the number of times a request was preempted.",
            VLLM_REQUEST_NUM_PREEMPTIONS,
        )
        self.iteration_tokens = hist(
            "vllm:iteration_tokens_total",  # vLLM's name: a histogram despite the suffix
            "Histogram of number of tokens per engine_step.",
            VLLM_ITERATION_TOKENS,
        )
        self._last_token: dict[str, float] = {}
        self._lock = threading.Lock()

    def tokens_out(self, outputs: list[RequestOutput], now: float) -> None:
        with self._lock:
            last = self._last_token
            for out in outputs:
                if out.new_token_ids:
                    before = last.get(out.request_id)
                    if before is not None:
                        self.itl.observe(now - before)
                    last[out.request_id] = now
                if out.finished:
                    last.pop(out.request_id, None)
            if len(last) > self.MAX_TRACKED:
                last.clear()

    def observe_finished(self, out: RequestOutput, generated: int) -> None:
        if out.finished_time is not None:
            self.phase["e2e"].observe(out.finished_time - out.arrival_time)
        scheduled, first, done = out.first_scheduled_time, out.first_token_time, out.finished_time
        if scheduled is not None:
            self.phase["queue"].observe(scheduled - out.arrival_time)
        if first is not None:
            self.ttft.observe(first - out.arrival_time)
            if scheduled is not None:
                self.phase["prefill"].observe(first - scheduled)
            if done is not None:
                self.phase["decode"].observe(done - first)
                if generated > 1:
                    self.tpot.observe((done - first) / (generated - 1))
        if scheduled is not None and done is not None:
            self.phase["inference"].observe(done - scheduled)
        self.count["prompt"].observe(out.num_prompt_tokens)
        self.count["generation"].observe(generated)
        self.count["max_generation"].observe(generated)  # n = 1: the request's own count
        self.count["prefill_kv"].observe(max(0, out.num_prompt_tokens - out.num_cached_tokens))
        self.params_n.observe(1)  # the gateway fans n out into n engine requests
        self.preemptions.observe(out.num_preemptions)


_vllm: list[VllmSeries | None] = [None]  # set by export()


class StatsCollector(Collector):
    """Gauges and engine-lifetime counters from the backend's latest snapshot; the
    counters are exported as counters (``rate()`` and resets work as Prometheus
    expects), the gauges as gauges (no gauge's name ends in ``_total``)."""

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
            ("engine_num_kv_blocks", "KV blocks in the pool", e.num_kv_blocks_total),
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


# engine_* counter or gauge -> vLLM's name for the same series (its histograms are
# VllmSeries' own: vLLM's buckets differ from the engine_* ones)
VLLM_NAMES = {
    "engine_num_requests_running": "vllm:num_requests_running",
    "engine_num_requests_waiting": "vllm:num_requests_waiting",
    "engine_kv_cache_usage_perc": "vllm:kv_cache_usage_perc",
    "engine_num_preemptions": "vllm:num_preemptions",
    "engine_prompt_tokens": "vllm:prompt_tokens",
    "engine_prompt_tokens_cached": "vllm:prompt_tokens_cached",
    "engine_generation_tokens": "vllm:generation_tokens",
    "engine_request_success": "vllm:request_success",
    "engine_prefix_cache_queries": "vllm:prefix_cache_queries",
    "engine_prefix_cache_hits": "vllm:prefix_cache_hits",
    "engine_spec_decode_num_draft_tokens": "vllm:spec_decode_num_draft_tokens",
    "engine_spec_decode_num_accepted_tokens": "vllm:spec_decode_num_accepted_tokens",
}


def _relabelled(family: Metric, name: str, labels: dict[str, str]) -> Metric:
    out = Metric(name, family.documentation, family.type, family.unit)
    for sample in family.samples:
        out.add_sample(
            name + sample.name[len(family.name) :],
            {**sample.labels, **labels},
            sample.value,
            sample.timestamp,
            sample.exemplar,
        )
    return out


class ExportCollector(Collector):
    """The engine's series with ``model_name``, under their names and vLLM's (whose
    series also carry ``engine``), and vLLM's own histograms."""

    def __init__(
        self,
        model_name: str,
        source: CollectorRegistry = ENGINE,
        vllm: CollectorRegistry | None = None,
    ) -> None:
        self.model_name, self.source, self.vllm = model_name, source, vllm

    def collect(self) -> Iterator[Metric]:
        own = {"model_name": self.model_name}
        theirs = {**own, "engine": VLLM_ENGINE_INDEX}
        for family in self.source.collect():
            yield _relabelled(family, family.name, own)
            if family.name in VLLM_NAMES:
                yield _relabelled(family, VLLM_NAMES[family.name], theirs)
        if self.vllm is not None:
            for family in self.vllm.collect():
                yield _relabelled(family, family.name, theirs)


def export(model_name: str, max_model_len: int = 2048) -> ExportCollector:
    """Publish the engine's series (with ``model_name``) and vLLM's on the process's
    /metrics; ``max_model_len`` caps vLLM's token-count buckets, as in vLLM."""
    series = VllmSeries(max_model_len)
    _vllm[0] = series
    collector = ExportCollector(model_name, vllm=series.registry)
    REGISTRY.register(collector)
    return collector
