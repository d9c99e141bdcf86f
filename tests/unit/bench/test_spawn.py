"""bench.loadlib.spawn: the one launcher's placement and the one tenant/key helper."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

from bench.loadlib.spawn import (
    BENCH_ENGINE_ENV,
    GATEWAY_ENV,
    StackSpec,
    on_cpus,
    setup_tenants,
    tenant_key,
)
from bench.loadlib.workload import TenantSpec
from llm.v1 import admin_pb2
from tests.unit.bench.fakes import FakeAdmin


def test_tenant_key_upserts_the_tenant_then_returns_a_key_of_it() -> None:
    admin = FakeAdmin()
    limits = admin_pb2.LimitPolicy(requests_per_minute=5)
    key = tenant_key(admin, "adm", admin_pb2.Tenant(id="bench", limits=limits))  # type: ignore[arg-type]
    assert key == "sk-2"
    (what, tenant, md), (what2, req, md2) = admin.calls
    assert (what, what2) == ("upsert", "key")
    assert tenant.id == "bench"
    assert tenant.limits.requests_per_minute == 5
    assert (req.tenant_id, req.name) == ("bench", "bench")
    assert md == md2 == (("authorization", "Bearer adm"),)


def test_setup_tenants_tags_each_tenant_and_stores_its_key(monkeypatch: Any) -> None:
    import contextlib

    from bench.loadlib import spawn

    admin = FakeAdmin()
    monkeypatch.setattr(spawn, "admin_client", lambda *_: contextlib.nullcontext(admin))
    tenants = [TenantSpec(name="gold", rpm=60), TenantSpec(name="free", rpm=6)]
    setup_tenants("addr", "adm", tenants, run_tag="-r1")
    upserts = [c[1] for c in admin.calls if c[0] == "upsert"]
    assert [t.id for t in upserts] == ["gold-r1", "free-r1"]
    assert [t.limits.requests_per_minute for t in upserts] == [60, 6]
    assert [t.key for t in tenants] == ["sk-2", "sk-4"]
    assert {c[1].name for c in admin.calls if c[0] == "key"} == {"bench-load"}


def test_stack_spec_defaults_are_the_load_bench_env_and_no_http_front(tmp_path: Any) -> None:
    spec = StackSpec(tmp_path, tmp_path)
    assert spec.engine_env == BENCH_ENGINE_ENV
    assert spec.engine_env is not BENCH_ENGINE_ENV
    assert spec.gateway_env == GATEWAY_ENV
    assert (spec.engine_module, spec.http_port, spec.engine_cpus) == ("engine_svc", -1, None)


def test_a_child_started_on_cpus_inherits_them_and_the_caller_gets_its_own_back() -> None:
    before = os.sched_getaffinity(0)
    one = {min(before)}
    probe = [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"]
    with on_cpus(one):
        inside = subprocess.run(probe, capture_output=True, text=True, check=True).stdout
    assert inside.strip() == str(sorted(one))
    assert os.sched_getaffinity(0) == before
    with on_cpus(None):
        assert os.sched_getaffinity(0) == before


def test_a_service_alone_starts_on_free_ports_and_stops_with_its_stack(
    tmp_path: Any, model_dir: Any
) -> None:
    """The one launcher for a bench of one service (tokenizer_bench, engine_grpc_bench,
    the peers' worker): flags after the stack's own win (no metrics server here)."""
    from bench.loadlib.spawn import Stack
    from common.procs import check_health

    stack = Stack.alone(tmp_path)
    quiet = ["--metrics-port", "-1", "--log-level", "warning", "--model-dir", str(model_dir)]
    try:
        server = stack.service("tok", "tokenizer_svc", quiet, timeout=60)
        assert check_health(server.address)
        assert stack.procs["tok"] is server
        assert server.metrics_port is None  # --metrics-port -1 won over the stack's 0
    finally:
        stack.stop()
    assert server.proc is not None
    assert server.proc.poll() is not None  # stopped
    assert (tmp_path / "tok.log").is_file()
