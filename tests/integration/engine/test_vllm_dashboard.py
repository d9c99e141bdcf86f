"""vLLM's example Grafana dashboard (examples/observability/prometheus_grafana/grafana.json
in vLLM's repository), pointed at our engine, shows data in every panel.

The dashboard is not bundled: the series each of its panels queries are listed here
(names, as vLLM exports them) and checked against the live engine's /metrics after one
request: each exists, carries the ``model_name`` the dashboard's variable selects on,
and, for the counters and histograms, has counted something.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from common.procs import ManagedProcess
from llm.v1 import engine_pb2, engine_pb2_grpc

pytestmark = pytest.mark.integration

_HIST = ("_bucket", "_sum", "_count")
# panel -> the series its queries read (histograms by their _bucket/_sum/_count)
DASHBOARD_PANELS: dict[str, list[str]] = {
    "end-to-end latency": [f"vllm:e2e_request_latency_seconds{s}" for s in _HIST],
    "token throughput": ["vllm:prompt_tokens_total", "vllm:generation_tokens_total"],
    "inter-token latency": [f"vllm:inter_token_latency_seconds{s}" for s in _HIST],
    "scheduler state": ["vllm:num_requests_running", "vllm:num_requests_waiting"],
    "time to first token": [f"vllm:time_to_first_token_seconds{s}" for s in _HIST],
    "cache utilization": ["vllm:kv_cache_usage_perc"],
    "prompt length heatmap": ["vllm:request_prompt_tokens_bucket"],
    "generation length heatmap": ["vllm:request_generation_tokens_bucket"],
    "finish reason": ["vllm:request_success_total"],
    "queue time": ["vllm:request_queue_time_seconds_sum"],
    "prefill and decode time": [
        "vllm:request_prefill_time_seconds_sum",
        "vllm:request_decode_time_seconds_sum",
    ],
    "max generation tokens": ["vllm:request_max_num_generation_tokens_sum"],
}
GAUGES = {"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"}
# the dashboard's template variable lists label_values(model_name)
VARIABLE_LABEL = "model_name"


def scrape(engine: ManagedProcess) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Sample name -> (labels, value) of every sample on the engine's /metrics."""
    url = f"http://127.0.0.1:{engine.metrics_port}/metrics"
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(url, timeout=10) as r:
        text = r.read().decode()
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


@pytest.fixture(scope="module")
def samples(engine_server: ManagedProcess) -> dict[str, list[tuple[dict[str, str], float]]]:
    with grpc.insecure_channel(engine_server.address) as ch:
        stub = engine_pb2_grpc.EngineStub(ch)
        req = engine_pb2.EngineGenerateRequest(
            request_id="vllm-dashboard",
            prompt_token_ids=[1, 2, 3, 4, 5, 6],
            sampling=engine_pb2.EngineSamplingParams(max_tokens=4, ignore_eos=True),
        )
        chunks = list(stub.Generate(req, timeout=120))
    assert sum(len(c.token_ids) for c in chunks) == 4
    return scrape(engine_server)


def model_names(samples: dict[str, list[tuple[dict[str, str], float]]]) -> Iterator[str]:
    for labels, _ in samples.get("engine_model_info", []):
        yield labels["model"]


Samples = dict[str, list[tuple[dict[str, str], float]]]


def problems(samples: Samples, model: str, panels: dict[str, list[str]]) -> list[str]:
    """What a panel would lack: a series with no sample for ``model``, or a counter or
    histogram that counted nothing."""
    out = []
    for panel, names in panels.items():
        for name in names:
            mine = [v for lbl, v in samples.get(name, []) if lbl.get(VARIABLE_LABEL) == model]
            if not mine:
                out.append(f"{panel}: {name} has no sample with model_name={model!r}")
            elif name not in GAUGES and not any(v > 0 for v in mine):
                out.append(f"{panel}: {name} counted nothing after a request")
    return out


def test_every_panel_has_data(samples: Samples) -> None:
    (model,) = set(model_names(samples))
    assert not problems(samples, model, DASHBOARD_PANELS)


def test_the_check_finds_what_a_panel_lacks(samples: Samples) -> None:
    (model,) = set(model_names(samples))
    found = problems(
        samples,
        model,
        {
            "retired name": ["vllm:gpu_cache_usage_perc"],
            "other model": ["vllm:generation_tokens_total"],
        },
    )
    assert len(found) == 1
    assert "gpu_cache_usage_perc" in found[0]
    assert problems(samples, "no-such-model", {"x": ["vllm:generation_tokens_total"]})


def test_vllms_labels_and_no_removed_series(samples: Samples) -> None:
    for name, rows in samples.items():
        if name.startswith("vllm:"):
            assert all({"model_name", "engine"} <= set(lbl) for lbl, _ in rows), name
    reasons = {lbl["finished_reason"] for lbl, _ in samples["vllm:request_success_total"]}
    assert "length" in reasons
    assert not [n for n in samples if n.startswith("vllm:time_per_output_token_seconds")]
