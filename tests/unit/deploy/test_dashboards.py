"""The Grafana dashboards are well formed, define the variables they use, and have
the per-version canary panels docs/operations.md §7 promises. (Whether their
queries read real series: tests/integration/deploy/test_dashboards_metrics.py.)"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest

from tests.unit.deploy.promql import (
    Query,
    dashboard_files,
    dashboard_queries,
    load_dashboard,
    panels,
    substitute,
)

DASHBOARDS = dashboard_files()


def test_reader_sees_every_selector() -> None:
    q = Query(
        "example",
        'histogram_quantile(0.95, sum by (le, version) (rate(x_bucket{model=~"a|b", le!="1"}'
        "[5m]))) / on (job) group_left (version) y offset 10m > 1e-3 and z",
    )
    assert [(s.metric, set(s.labels)) for s in q.selectors()] == [
        ("x_bucket", {"model", "le"}),
        ("y", set()),
        ("z", set()),
    ]
    assert q.grouping_labels() == {"le", "version", "job"}


def test_substitute_replaces_variables_and_refuses_unknown_ones() -> None:
    expr = 'rate(a{m=~"$model", v=~"${version}", i=~"[[instance]]"}[$__rate_interval])'
    got = substitute(expr, {"model", "version", "instance"})
    assert got == 'rate(a{m=~".*", v=~".*", i=~".*"}[5m])'
    with pytest.raises(KeyError, match=r"\$model"):
        substitute(expr, {"version", "instance"})


def overlaps(a: dict[str, int], b: dict[str, int]) -> bool:
    return (
        a["x"] < b["x"] + b["w"]
        and b["x"] < a["x"] + a["w"]
        and a["y"] < b["y"] + b["h"]
        and b["y"] < a["y"] + a["h"]
    )


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_dashboard_is_well_formed(path: Path) -> None:
    d = load_dashboard(path)
    assert d["uid"]
    assert d["title"]
    every = list(panels(d))
    assert len({p["id"] for p in every}) == len(every)
    for p in every:
        grid = p["gridPos"]
        assert grid["x"] + grid["w"] <= 24, p["title"]
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert refs, p["title"]
        assert len(refs) == len(set(refs)), p["title"]
    for a, b in itertools.combinations(every, 2):
        assert not overlaps(a["gridPos"], b["gridPos"]), (a["title"], b["title"])
    names = {v["name"] for v in d["templating"]["list"]}
    assert {"datasource", "model", "instance"} <= names
    assert dashboard_queries(path)  # raises on a variable the dashboard does not define


def test_dashboard_uids_are_unique() -> None:
    uids = [load_dashboard(p)["uid"] for p in DASHBOARDS]
    assert len(uids) == len(set(uids))


def grouped_by(d: dict[str, Any], metric: str, label: str) -> list[str]:
    """Titles of panels with a query that reads ``metric`` grouped by ``label``."""
    out = []
    for p in panels(d):
        for t in p.get("targets", []):
            q = Query("", t["expr"])
            if label in q.grouping_labels() and metric in {s.metric for s in q.selectors()}:
                out.append(p["title"])
    return out


@pytest.mark.parametrize(
    "metric",
    [
        "gateway_time_to_first_token_seconds_bucket",
        "gateway_requests_total",
        "gateway_e2e_latency_seconds_bucket",
        "gateway_version_attempts_total",
        "gateway_routing_weight_percent",
        "gateway_shadow_requests_total",
        "gateway_shadow_time_to_first_token_seconds_bucket",
    ],
)
def test_releases_dashboard_has_per_version_panels(metric: str) -> None:
    releases = load_dashboard(next(p for p in DASHBOARDS if p.name == "llm-releases.json"))
    assert grouped_by(releases, metric, "version"), metric


def test_releases_dashboard_covers_replicas_rollbacks_and_budgets() -> None:
    path = next(p for p in DASHBOARDS if p.name == "llm-releases.json")
    read = {s.metric for q in dashboard_queries(path) for s in q.selectors()}
    for metric in (
        "gateway_routing_rollbacks_total",
        "gateway_replica_healthy",
        "gateway_breaker_state",
        "gateway_prefix_index_blocks",
        "engine_model_info",
        "ratelimit_budget_used_ratio",
        "ratelimit_budget_events_total",
        "gateway_shadow_skipped_total",
        "llm:ttft_over_slo:ratio_rate5m",
        "llm:request_errors:ratio_rate5m",
    ):
        assert metric in read, metric
    annotations = load_dashboard(path)["annotations"]["list"]
    assert any("gateway_routing_rollbacks_total" in a["expr"] for a in annotations)
