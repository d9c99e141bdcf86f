"""Every query the dashboards and the Prometheus rules run reads series that the real
services export.

Starts Redis, a gateway in front of the session's engine and tokenizer (real model),
and Envoy with its stats listener, all on ephemeral ports; drives what creates the
lazily made series (a request of a tenant with a budget, a routing policy with
shadow traffic, a rollback, a tokenizer call); scrapes every /metrics; then checks
each selector of deploy/grafana/dashboards/*.json and deploy/prometheus/rules/*.yml:
the metric exists (a histogram's _bucket/_sum/_count, or a recording rule's output),
the labels it matches on are labels of that series (or added by Prometheus at scrape
time), and its grouping clauses name labels the series have.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from common.procs import ManagedProcess
from common.redis_server import RedisServer, free_port
from deploy.envoy import EnvoyProcess, render_config_file
from llm.v1 import admin_pb2, admin_pb2_grpc, gateway_pb2, tokenizer_pb2, tokenizer_pb2_grpc
from tests.integration.gateway.conftest import GatewayProcess, chat, start_gateway
from tests.unit.deploy.promql import (
    Query,
    dashboard_files,
    dashboard_queries,
    recorded,
    rule_queries,
)

pytestmark = pytest.mark.integration

# labels Prometheus adds at scrape time (prometheus.yml; prometheus-k8s.yml adds pod, namespace)
TARGET_LABELS = frozenset({"job", "instance", "pod", "namespace"})
# series Prometheus makes itself; the rules may read them (LLMEngineDown), dashboards do not
PROMETHEUS_OWN = {"up": frozenset(TARGET_LABELS)}
SUFFIXES = {"histogram": ("_bucket", "_sum", "_count"), "summary": ("", "_sum", "_count")}
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@dataclass
class Exported:
    """What a set of scrapes offers: every series name, and the label names seen on
    the samples of each (a labelled metric nothing has touched yet has a name, from
    its TYPE line, and no samples)."""

    names: set[str] = field(default_factory=set)
    labels: dict[str, set[str]] = field(default_factory=dict)

    def add(self, text: str) -> None:
        for line in text.splitlines():
            if line.startswith("# TYPE "):
                _, _, name, kind = line.split(maxsplit=3)
                self.names |= {name + s for s in SUFFIXES.get(kind, ("",))}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                self.names.add(sample.name)
                self.labels.setdefault(sample.name, set()).update(sample.labels)


@dataclass
class Stack:
    gateway: GatewayProcess
    envoy: EnvoyProcess
    engine: ManagedProcess
    tokenizer: ManagedProcess

    def scrape(self) -> dict[str, str]:
        urls = {
            "gateway": f"http://127.0.0.1:{self.gateway.proc.metrics_port}/metrics",
            "engine": f"http://127.0.0.1:{self.engine.metrics_port}/metrics",
            "tokenizer": f"http://127.0.0.1:{self.tokenizer.metrics_port}/metrics",
            "envoy": f"http://127.0.0.1:{self.envoy.listener_port('stats')}/stats/prometheus",
        }
        out = {}
        for job, url in urls.items():
            with _NO_PROXY.open(url, timeout=10) as resp:
                out[job] = resp.read().decode()
        return out


def drive(stack: Stack) -> None:
    """What creates the lazily made series the dashboards and rules read."""
    gw = stack.gateway
    tid, key = gw.tenant()
    tenant = gw.admin.GetTenant(admin_pb2.GetTenantRequest(tenant_id=tid), metadata=gw.admin_md)
    tenant.budgets.append(
        admin_pb2.Budget(
            name="daily",
            metric=admin_pb2.BudgetMetric.Value("BUDGET_TOKENS"),
            period=admin_pb2.BudgetPeriod.Value("BUDGET_DAY"),
            limit=1_000,
            warn_percent=1,  # the first request passes it: a "warned" event
        )
    )
    gw.admin.UpsertTenant(tenant, metadata=gw.admin_md)
    auth = (("authorization", f"Bearer {key}"),)
    (card,) = gw.stub.ListModels(gateway_pb2.ListModelsRequest(), metadata=auth).models
    (version,) = (v.version for v in card.versions)
    routing = admin_pb2_grpc.RoutingAdminStub(gw.channel)
    routing.SetRoutingPolicy(
        admin_pb2.RoutingPolicy(
            model=card.id,
            stable_version=version,
            weights={version: 100},
            shadow=admin_pb2.ShadowPolicy(version="no-such-version", percent=100),
            reason="dashboard test",
        ),
        metadata=gw.admin_md,
    )
    for _ in range(2):
        chunks = gw.generate(key, chat("Name a color.", max_tokens=4, temperature=0))
        assert chunks[-1].finish_reason != 0
    routing.Rollback(
        admin_pb2.RollbackRequest(model=card.id, reason="dashboard test"),
        metadata=gw.admin_md,
    )
    _, limited = gw.tenant(requests_per_minute=1)  # its second request is denied
    gw.generate(limited, chat("Hi", max_tokens=2))
    with pytest.raises(grpc.RpcError) as denied:
        gw.generate(limited, chat("Hi", max_tokens=2))
    assert denied.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    with grpc.insecure_channel(stack.tokenizer.address) as channel:
        tokenizer_pb2_grpc.TokenizerStub(channel).Encode(
            tokenizer_pb2.EncodeRequest(text="Hello"), timeout=30
        )


@pytest.fixture(scope="module")
def exported(
    engine_server: ManagedProcess,
    tokenizer_server: ManagedProcess,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Exported]:
    workdir = tmp_path_factory.mktemp("dashboards")
    redis = RedisServer().start()
    try:
        gw = start_gateway(
            "dash-gateway",
            [engine_server.address],
            tokenizer_server.address,
            redis.url,
            workdir,
        )
        try:
            config = render_config_file(
                workdir / "envoy.yaml",
                listener_host="127.0.0.1",
                plaintext=True,  # loopback; only the stats listener is read
                listener_port=0,
                admin_port=free_port(),  # the stats listener proxies to it
                stats_port=0,
                gateway=[gw.proc.address],
                admin=[gw.proc.address],
                access_log_path=workdir / "envoy-access.log",
            )
            with EnvoyProcess(config, log_dir=workdir) as envoy:
                stack = Stack(gw, envoy, engine_server, tokenizer_server)
                drive(stack)
                out = Exported()
                for text in stack.scrape().values():
                    out.add(text)
                yield out
        finally:
            gw.stop()
    finally:
        redis.close()


def known_labels(exported: Exported, rules_too: bool) -> dict[str, frozenset[str]]:
    """Metric name -> label names a query may use on it, where known: sampled series
    (plus the scrape's target labels) and recording rules' outputs (their grouping
    labels). Names exported without samples yet are absent."""
    known = {n: frozenset(lbls | TARGET_LABELS) for n, lbls in exported.labels.items()}
    known.update({n: frozenset(lbls) for n, lbls in recorded().items()})
    if rules_too:
        known.update(PROMETHEUS_OWN)
    return known


def problems(queries: list[Query], exported: Exported, rules_too: bool) -> list[str]:
    known = known_labels(exported, rules_too)
    names = exported.names | set(known)
    out = []
    for q in queries:
        sels = q.selectors()
        assert sels, f"{q.where}: no series selector in {q.expr!r}"
        for sel in sels:
            if sel.metric not in names:
                out.append(f"{q.where}: {sel.metric} is not exported by any service")
            elif sel.metric in known and not sel.labels <= known[sel.metric]:
                bad = sorted(sel.labels - known[sel.metric])
                out.append(f"{q.where}: {sel.metric} has no label {bad}")
        if all(s.metric in known for s in sels):
            available = set().union(*(known[s.metric] for s in sels)) | TARGET_LABELS | {"le"}
            if not q.grouping_labels() <= available:
                bad = sorted(q.grouping_labels() - available)
                out.append(f"{q.where}: groups by {bad}, which none of its series has")
    return out


def test_the_drive_made_the_lazy_series(exported: Exported) -> None:
    # the label checks below are only as good as the series that have samples
    for name in (
        "gateway_time_to_first_token_seconds_bucket",
        "gateway_requests_total",
        "gateway_version_attempts_total",
        "gateway_routing_weight_percent",
        "gateway_routing_rollbacks_total",
        "gateway_shadow_skipped_total",
        "gateway_replica_healthy",
        "gateway_breaker_state",
        "ratelimit_budget_used_ratio",
        "ratelimit_decisions_total",
        "ratelimit_denials_total",
        "ratelimit_budget_events_total",
        "gateway_ratelimit_denials_total",
        "engine_time_to_first_token_seconds_bucket",
        "engine_model_info",
        "engine_num_requests_waiting",
        "tokenizer_requests_total",
        "envoy_cluster_upstream_rq_total",
    ):
        assert name in exported.labels, name
    assert {"model", "version"} <= exported.labels["gateway_time_to_first_token_seconds_bucket"]
    assert "model_name" in exported.labels["engine_num_requests_waiting"]


def test_every_dashboard_query_reads_exported_series(exported: Exported) -> None:
    queries = [q for path in dashboard_files() for q in dashboard_queries(path)]
    assert len(dashboard_files()) >= 2
    assert not problems(queries, exported, rules_too=False)


def test_every_rule_reads_exported_series(exported: Exported) -> None:
    assert not problems(rule_queries(), exported, rules_too=True)


def test_the_check_finds_a_wrong_name_and_a_wrong_label(exported: Exported) -> None:
    wrong = [
        Query("typo", "sum(rate(gateway_request_total[5m]))"),
        Query("label", 'engine_num_requests_waiting{model=~".*"}'),
        Query("grouping", "sum by (model) (engine_kv_cache_usage_perc)"),
    ]
    found = problems(wrong, exported, rules_too=False)
    assert len(found) == 3, found
    assert "gateway_request_total is not exported" in found[0]
    assert "has no label ['model']" in found[1]
    assert "groups by ['model']" in found[2]
    assert not problems([Query("up", "up == 0")], exported, rules_too=True)
    assert problems([Query("up", "up == 0")], exported, rules_too=False)
