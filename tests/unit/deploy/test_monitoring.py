"""Grafana dashboard and Prometheus configs: parse, and query only metrics that exist."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import yaml
from prometheus_client.metrics import MetricWrapperBase

from ratelimit import metrics as ratelimit_metrics
from tests.unit.deploy.helpers import (
    DEPLOY,
    ENVOY_DASHBOARD_METRICS,
    ENVOY_STATS_PORT,
    load_yaml_docs,
    service_ports,
)

HISTOGRAMS = {
    "engine_time_to_first_token_seconds",
    "engine_time_per_output_token_seconds",
    "engine_e2e_request_latency_seconds",
    "engine_request_queue_time_seconds",
    "gateway_time_to_first_token_seconds",
    "gateway_e2e_latency_seconds",
    "gateway_overhead_seconds",
    "gateway_stage_seconds",
    "tokenizer_request_seconds",
}
PLAIN = {
    "engine_num_requests_running",
    "engine_num_requests_waiting",
    "engine_kv_cache_usage_perc",
    "engine_num_preemptions_total",
    "engine_prompt_tokens_total",
    "engine_generation_tokens_total",
    "engine_prefix_cache_queries_total",
    "engine_prefix_cache_hits_total",
    "engine_request_success_total",
    "engine_request_errors_total",
    "gateway_requests_total",
    "gateway_tokens_charged_total",
    "gateway_retries_total",
    "gateway_failovers_total",
    "gateway_breaker_state",
    "gateway_ratelimit_denials_total",
    "tokenizer_requests_total",
}
PROMQL_WORDS = {
    "sum",
    "max",
    "min",
    "avg",
    "count",
    "rate",
    "irate",
    "increase",
    "histogram_quantile",
    "by",
    "without",
    "on",
    "ignoring",
    "and",
    "or",
    "unless",
    "le",
    "offset",
}


def ratelimit_names() -> set[str]:
    names = set()
    for obj in vars(ratelimit_metrics).values():
        if isinstance(obj, MetricWrapperBase):
            base = obj._name
            kind = obj._type
            if kind == "counter":
                names.add(base + "_total")
            elif kind == "histogram":
                names |= {base + s for s in ("_bucket", "_sum", "_count")}
            else:
                names.add(base)
    return names


def known_metrics() -> set[str]:
    hist = {h + s for h in HISTOGRAMS for s in ("_bucket", "_sum", "_count")}
    return hist | PLAIN | ENVOY_DASHBOARD_METRICS | ratelimit_names()


def metrics_in(expr: str) -> set[str]:
    """Metric names a PromQL expression reads (labels, ranges and functions removed)."""
    s = re.sub(r'"[^"]*"', "", expr)
    s = re.sub(r"\{[^}]*\}", "", s)
    s = re.sub(r"\[[^\]]*\]", "", s)
    s = re.sub(r"\b(by|without)\s*\([^)]*\)", "", s)
    s = re.sub(r"\$\w+", "", s)
    tokens = set(re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", s))
    return {t for t in tokens if t not in PROMQL_WORDS}


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    doc = json.loads((DEPLOY / "grafana" / "dashboards" / "llm-stack.json").read_text())
    assert isinstance(doc, dict)
    return doc


def exprs(dashboard: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def test_metric_extraction() -> None:
    assert metrics_in(
        "histogram_quantile(0.95, sum by (le, priority) "
        '(rate(engine_request_queue_time_seconds_bucket{tenant=~"$tenant"}'
        "[$__rate_interval])))"
    ) == {"engine_request_queue_time_seconds_bucket"}
    assert metrics_in("sum(rate(a_total[5m])) / sum(rate(b_total[5m]))") == {"a_total", "b_total"}


def test_dashboard_queries_only_known_metrics(dashboard: dict[str, Any]) -> None:
    used = set().union(*(metrics_in(e) for e in exprs(dashboard)))
    unknown = used - known_metrics()
    assert not unknown, f"dashboard queries metrics no service exposes: {sorted(unknown)}"


def test_dashboard_covers_what_ops_watch(dashboard: dict[str, Any]) -> None:
    used = set().union(*(metrics_in(e) for e in exprs(dashboard)))
    for needed in (
        "engine_time_to_first_token_seconds_bucket",
        "engine_time_per_output_token_seconds_bucket",
        "engine_generation_tokens_total",
        "engine_num_requests_waiting",
        "engine_kv_cache_usage_perc",
        "engine_request_errors_total",
        "gateway_ratelimit_denials_total",
        "gateway_tokens_charged_total",
    ):
        assert needed in used, needed


def test_dashboard_is_well_formed(dashboard: dict[str, Any]) -> None:
    assert dashboard["uid"]
    assert dashboard["title"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["targets"], panel["title"]
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs))
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    for e in exprs(dashboard):
        for var in re.findall(r"\$(\w+)", e):
            assert var in variables or var.startswith("__"), var


def test_compose_prometheus_scrapes_every_metrics_port() -> None:
    doc = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    targets: dict[str, set[str]] = {}
    for job in doc["scrape_configs"]:
        for sc in job.get("static_configs", []):
            targets.setdefault(job["job_name"], set()).update(sc["targets"])
        for sd in job.get("dns_sd_configs", []):
            targets.setdefault(job["job_name"], set()).update(
                f"{n}:{sd['port']}" for n in sd["names"]
            )
    assert targets["tokenizer"] == {f"tokenizer:{service_ports('tokenizer')['metrics_port']}"}
    assert targets["engine"] == {f"engine:{service_ports('engine')['metrics_port']}"}
    assert targets["gateway"] == {f"gateway:{service_ports('gateway')['metrics_port']}"}
    assert targets["envoy"] == {f"envoy:{ENVOY_STATS_PORT}"}
    envoy_job = next(j for j in doc["scrape_configs"] if j["job_name"] == "envoy")
    assert envoy_job["metrics_path"] == "/stats/prometheus"


def test_k8s_prometheus_config_and_pod_annotations_agree() -> None:
    doc = yaml.safe_load((DEPLOY / "prometheus" / "prometheus-k8s.yml").read_text())
    (job,) = doc["scrape_configs"]
    assert job["kubernetes_sd_configs"][0]["role"] == "pod"
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        for d in load_yaml_docs(path):
            if d.get("kind") not in ("Deployment", "StatefulSet"):
                continue
            ann = d["spec"]["template"]["metadata"].get("annotations", {})
            if ann.get("prometheus.io/scrape") != "true":
                continue
            ports = {
                p["containerPort"]
                for c in d["spec"]["template"]["spec"]["containers"]
                for p in c["ports"]
            }
            assert int(ann["prometheus.io/port"]) in ports, d["metadata"]["name"]


def test_grafana_provisioning_points_at_the_dashboards() -> None:
    prov = DEPLOY / "grafana" / "provisioning"
    ds = yaml.safe_load((prov / "datasources" / "prometheus.yaml").read_text())
    assert ds["datasources"][0]["uid"] == "prometheus"
    dash = yaml.safe_load((prov / "dashboards" / "llm-stack.yaml").read_text())
    assert dash["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
