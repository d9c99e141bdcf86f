"""A request's own priority, capped at its tenant's class, reaches the engines
(real gateway, engines, Redis; the engines' per-priority metrics are the witness)."""

from __future__ import annotations

import secrets
import time
import urllib.request

import grpc
import openai
import pytest

from llm.v1 import admin_pb2, common_pb2, engine_pb2, engine_pb2_grpc
from tests.integration.gateway.conftest import (
    EnginePair,
    GatewayProcess,
    HttpGateway,
    chat,
)

pytestmark = pytest.mark.integration
FINISHED = "engine_e2e_request_latency_seconds_count"


def wait_idle(engines: EnginePair, timeout: float = 30.0) -> None:
    """Until no engine runs or queues anything (a stream an earlier test cancelled
    would otherwise finish inside this test's window)."""
    end = time.monotonic() + timeout
    for address in engines.addresses:
        with grpc.insecure_channel(address) as ch:
            stub = engine_pb2_grpc.EngineStub(ch)
            while True:
                s = stub.GetStats(engine_pb2.GetStatsRequest(), timeout=5)
                if s.num_running == 0 and s.num_waiting == 0:
                    break
                assert time.monotonic() < end, f"engine {address} never went idle"
                time.sleep(0.05)


def finished_by_priority(engines: EnginePair) -> dict[str, float]:
    """Requests the engines finished, per priority label, summed over replicas."""
    wait_idle(engines)
    out: dict[str, float] = {}
    for proc in engines.procs:
        url = f"http://127.0.0.1:{proc.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as resp:
            for line in resp.read().decode().splitlines():
                if line.startswith(FINISHED + "{"):
                    head, value = line.rsplit(" ", 1)
                    label = head.split('priority="', 1)[1].split('"', 1)[0]
                    out[label] = out.get(label, 0.0) + float(value)
    return out


def tenant_of_class(gw: GatewayProcess, priority: common_pb2.Priority.ValueType) -> str:
    tid = f"prio-{secrets.token_hex(3)}"
    gw.admin.UpsertTenant(admin_pb2.Tenant(id=tid, priority=priority), metadata=gw.admin_md)
    return gw.admin.CreateApiKey(
        admin_pb2.CreateApiKeyRequest(tenant_id=tid, name="prio"), metadata=gw.admin_md
    ).key


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in ("LOW", "NORMAL", "CRITICAL")}


def test_a_request_runs_below_its_tenants_class_never_above(
    gateway: GatewayProcess, engines: EnginePair
) -> None:
    critical = tenant_of_class(gateway, common_pb2.Priority.CRITICAL)
    normal = tenant_of_class(gateway, common_pb2.Priority.NORMAL)
    before = finished_by_priority(engines)
    low_req = chat("Hi", 2)
    low_req.priority = common_pb2.Priority.LOW
    gateway.generate(critical, low_req)  # batch work of a CRITICAL team
    gateway.generate(critical, chat("Hi", 2))  # unspecified: the tenant's class
    up_req = chat("Hi", 2)
    up_req.priority = common_pb2.Priority.CRITICAL
    gateway.generate(normal, up_req)  # asks above its class: runs NORMAL
    assert delta(before, finished_by_priority(engines)) == {
        "LOW": 1.0,
        "NORMAL": 1.0,
        "CRITICAL": 1.0,
    }


def test_an_unknown_priority_is_invalid_argument(gateway: GatewayProcess) -> None:
    req = chat("Hi", 2)
    req.priority = 7  # type: ignore[assignment]
    with pytest.raises(grpc.RpcError) as err:
        gateway.generate(tenant_of_class(gateway, common_pb2.Priority.NORMAL), req)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "priority 7 is not one of LOW" in (err.value.details() or "")


def test_the_http_priority_extension(http_gateway: HttpGateway, engines: EnginePair) -> None:
    key = tenant_of_class(http_gateway.gw, common_pb2.Priority.NORMAL)
    with openai.OpenAI(base_url=http_gateway.base_url, api_key=key, max_retries=0) as client:
        before = finished_by_priority(engines)
        client.completions.create(
            model="", prompt="Hi", max_tokens=2, extra_body={"priority": "low"}
        )
        assert delta(before, finished_by_priority(engines))["LOW"] == 1.0
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(
                model="", prompt="Hi", max_tokens=2, extra_body={"priority": "urgent"}
            )
        assert "priority must be" in str(err.value)
