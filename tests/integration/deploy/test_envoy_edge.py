"""The real Envoy with the real config: gRPC routing, HTTP/JSON transcoding, admin, logs."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
import uuid
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llm.v1 import admin_pb2, admin_pb2_grpc, gateway_pb2, gateway_pb2_grpc
from tests.integration.deploy.conftest import ADMIN_KEY, Edge
from tests.unit.deploy.helpers import ENVOY_DASHBOARD_METRICS

pytestmark = pytest.mark.integration

AUTH = (("authorization", f"Bearer {ADMIN_KEY}"),)
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def http(
    edge: Edge,
    method: str,
    path: str,
    body: dict[str, Any] | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, Any], dict[str, str]]:
    """One HTTP/1.1 call to Envoy's public listener: (status, JSON body, headers)."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(edge.http_url + path, data=data, method=method)
    req.add_header("content-type", "application/json")
    for key, value in (headers or {}).items():
        req.add_header(key, value)
    try:
        with _OPENER.open(req, timeout=10) as resp:
            raw, status, hdrs = resp.read(), resp.status, dict(resp.headers)
    except urllib.error.HTTPError as err:
        raw, status, hdrs = err.read(), err.code, dict(err.headers)
    try:
        payload = json.loads(raw) if raw.strip() else {}
    except json.JSONDecodeError:  # Envoy's own errors are plain text
        payload = {"text": raw.decode(errors="replace")}
    return int(status), payload, {k.lower(): v for k, v in hdrs.items()}


ADMIN_HEADERS = {"authorization": f"Bearer {ADMIN_KEY}"}


def tenant_id() -> str:
    return f"team-{uuid.uuid4().hex[:8]}"


def test_grpc_admin_call_through_envoy(edge: Edge) -> None:
    tid = tenant_id()
    with grpc.insecure_channel(edge.address) as channel:
        stub = admin_pb2_grpc.RateLimitAdminStub(channel)
        tenant = admin_pb2.Tenant(
            id=tid, limits=admin_pb2.LimitPolicy(requests_per_minute=60, max_concurrent=2)
        )
        stub.UpsertTenant(tenant, metadata=AUTH, timeout=10)
        got = stub.GetTenant(admin_pb2.GetTenantRequest(tenant_id=tid), metadata=AUTH, timeout=10)
        assert got.limits.requests_per_minute == 60
        assert got.limits.max_concurrent == 2
        with pytest.raises(grpc.RpcError) as info:
            stub.GetTenant(admin_pb2.GetTenantRequest(tenant_id=tid), timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_http_json_put_then_get_tenant(edge: Edge) -> None:
    tid = tenant_id()
    body = {
        "limits": {"requests_per_minute": 120, "tokens_per_minute": 50000},
        "priority": "CRITICAL",
        "display_name": "Team A",
    }
    status, put, _ = http(edge, "PUT", f"/v1/admin/tenants/{tid}", body, ADMIN_HEADERS)
    assert status == 200, put
    assert put["id"] == tid
    status, got, _ = http(edge, "GET", f"/v1/admin/tenants/{tid}", headers=ADMIN_HEADERS)
    assert status == 200, got
    assert got["id"] == tid
    assert got["priority"] == "CRITICAL"
    assert got["display_name"] == "Team A"  # proto field names, not lowerCamelCase
    # uint64 is a JSON string (proto3 JSON mapping); uint32 a number
    assert got["limits"]["requests_per_minute"] == 120
    assert got["limits"]["tokens_per_minute"] == "50000"
    assert got["limits"]["max_concurrent"] == 0  # defaults are printed too
    status, listed, _ = http(edge, "GET", "/v1/admin/tenants", headers=ADMIN_HEADERS)
    assert status == 200
    assert tid in [t["id"] for t in listed["tenants"]]


def test_http_json_key_and_usage_paths(edge: Edge) -> None:
    tid = tenant_id()
    status, _, _ = http(
        edge,
        "PUT",
        f"/v1/admin/tenants/{tid}",
        {"limits": {"requests_per_minute": 10}},
        ADMIN_HEADERS,
    )
    assert status == 200
    status, created, _ = http(
        edge,
        "POST",
        f"/v1/admin/tenants/{tid}/keys",
        {"name": "ci", "role": "TENANT"},
        ADMIN_HEADERS,
    )
    assert status == 200, created
    assert created["key"]
    assert created["api_key"]["tenant_id"] == tid
    status, usage, _ = http(edge, "GET", f"/v1/admin/tenants/{tid}/usage", headers=ADMIN_HEADERS)
    assert status == 200, usage
    assert usage["tenant_id"] == tid
    assert usage["limits"]["requests_per_minute"] == 10
    key_id = created["api_key"]["key_id"]
    status, revoked, _ = http(edge, "DELETE", f"/v1/admin/keys/{key_id}", headers=ADMIN_HEADERS)
    assert status == 200, revoked
    assert revoked["api_key"]["revoked"] is True


@pytest.mark.parametrize(
    ("method", "path", "body", "headers", "code", "grpc_code"),
    [
        ("GET", "/v1/admin/tenants/no-such-tenant", None, ADMIN_HEADERS, 404, 5),
        ("GET", "/v1/admin/tenants", None, {}, 401, 16),
        ("GET", "/v1/admin/tenants", None, {"authorization": "Bearer sk-llm-" + "x" * 40}, 401, 16),
        ("PUT", "/v1/admin/tenants/bad%20id!", {}, ADMIN_HEADERS, 400, 3),
        (
            "PUT",
            "/v1/admin/tenants/t1",
            {"limits": {"requests_per_minute": "many"}},
            ADMIN_HEADERS,
            400,
            None,
        ),
    ],
    ids=["not-found", "no-key", "unknown-key", "invalid-id", "malformed-json"],
)
def test_grpc_status_becomes_http_code(
    edge: Edge,
    method: str,
    path: str,
    body: dict[str, Any] | None,
    headers: dict[str, str],
    code: int,
    grpc_code: int | None,
) -> None:
    status, payload, _ = http(edge, method, path, body, headers)
    assert status == code, payload
    if grpc_code is not None:  # a google.rpc.Status from convert_grpc_status
        assert payload["code"] == grpc_code, payload
        assert payload["message"], payload
    else:  # rejected by the transcoder itself, naming the bad field
        assert "requests_per_minute" in payload["text"], payload


def test_unknown_admin_path_is_not_forwarded(edge: Edge) -> None:
    status, _, _ = http(edge, "GET", "/v1/admin/nothing-here", headers=ADMIN_HEADERS)
    assert status == 404
    status, _, _ = http(edge, "GET", "/v1/admin/tenants?unknown_param=1", headers=ADMIN_HEADERS)
    assert status == 400


def test_dead_gateway_gives_unavailable_after_connect_retries(edge: Edge) -> None:
    with grpc.insecure_channel(edge.address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.ListModels(gateway_pb2.ListModelsRequest(), timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_health_route_reaches_upstream_health(edge: Edge) -> None:
    with grpc.insecure_channel(edge.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
    # /grpc.health.v1.Health/ goes to the gateway cluster, which has no live host here
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_envoy_admin_is_a_private_unix_socket(edge: Edge) -> None:
    """Nothing on the network reaches the admin interface: it is a unix socket only
    Envoy's user may open (the full check: test_envoy_admin_socket.py)."""
    assert edge.envoy.admin_address.startswith("unix:")
    assert edge.envoy.admin_socket.stat().st_mode & 0o777 == 0o600
    status, body = edge.envoy.admin_get("/server_info")
    assert status == 200
    assert json.loads(body)["state"] == "LIVE"


def test_access_log_is_json_with_the_request_id(edge: Edge) -> None:
    rid = f"req-{uuid.uuid4().hex}"
    status, _, headers = http(
        edge, "GET", "/v1/admin/tenants", headers={**ADMIN_HEADERS, "x-request-id": rid}
    )
    assert status == 200
    assert headers["x-request-id"] == rid  # kept and echoed
    status, _, headers = http(edge, "GET", "/v1/admin/tenants", headers=ADMIN_HEADERS)
    generated = headers["x-request-id"]
    assert generated
    assert generated != rid
    with grpc.insecure_channel(edge.address) as channel:
        stub = admin_pb2_grpc.RateLimitAdminStub(channel)
        grpc_rid = f"grpc-{uuid.uuid4().hex}"
        with pytest.raises(grpc.RpcError):
            stub.GetTenant(
                admin_pb2.GetTenantRequest(tenant_id="missing"),
                metadata=(*AUTH, ("x-request-id", grpc_rid)),
                timeout=10,
            )
    entries = [json.loads(line) for line in _wait_for_lines(edge, {rid, generated, grpc_rid})]
    by_id = {e["request_id"]: e for e in entries}
    assert by_id[rid]["path"] == "/v1/admin/tenants"
    assert by_id[rid]["response_code"] == 200
    assert by_id[rid]["upstream_cluster"] == "admin"
    assert by_id[generated]["method"] == "GET"
    assert by_id[grpc_rid]["path"] == "/llm.v1.RateLimitAdmin/GetTenant"
    assert by_id[grpc_rid]["grpc_status"] == "NotFound"
    assert by_id[grpc_rid]["protocol"] == "HTTP/2"
    for entry in entries:
        assert "authorization" not in json.dumps(entry).lower()


def test_stats_the_dashboard_reads_exist(edge: Edge) -> None:
    status, body = edge.envoy.admin_get("/stats/prometheus")
    assert status == 200
    names = {
        line.split("{")[0].split(" ")[0]
        for line in body.splitlines()
        if line and not line.startswith("#")
    }
    missing = ENVOY_DASHBOARD_METRICS - names
    assert not missing, sorted(missing)


def _wait_for_lines(edge: Edge, request_ids: set[str]) -> list[str]:
    """Access log lines mentioning the ids (Envoy flushes the file log asynchronously)."""
    import time

    deadline = time.monotonic() + 15
    while True:
        lines = edge.access_log_lines()
        found = [ln for ln in lines if any(r in ln for r in request_ids)]
        seen = {r for r in request_ids if any(r in ln for ln in found)}
        if seen == request_ids or time.monotonic() > deadline:
            return found
        time.sleep(0.1)
