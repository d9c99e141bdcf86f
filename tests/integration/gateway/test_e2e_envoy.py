"""End to end through a real Envoy: tenants' gRPC streams, admin over HTTP/JSON, failover
between gateway replicas."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from common.procs import ManagedProcess
from common.redis_server import RedisServer
from deploy.envoy import EnvoyProcess
from llm.v1 import common_pb2, gateway_pb2_grpc
from tests.integration.gateway.conftest import (
    ADMIN_KEY,
    EnginePair,
    GatewayProcess,
    chat,
    envoy_over,
    start_gateway,
    trailers,
)

pytestmark = pytest.mark.integration

# Each gateway replica caches tenants (policies, keys) this long; a change made
# through one replica reaches the others within it ([ratelimit] auth_cache_ttl_ms).
CACHE_TTL_MS = 1000


@pytest.fixture(scope="module")
def edge(
    engines: EnginePair,
    tokenizer_server: ManagedProcess,
    gw_redis: RedisServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[EnvoyProcess, list[GatewayProcess]]]:
    """Two gateway replicas (one Redis) behind one Envoy, all on ephemeral ports."""
    engines.ensure_running()
    logs = tmp_path_factory.mktemp("e2e-envoy")
    gws = [
        start_gateway(
            f"e2e-gw-{i}",
            engines.addresses,
            tokenizer_server.address,
            gw_redis.url,
            logs,
            env={"LLM_RATELIMIT_AUTH_CACHE_TTL_MS": str(CACHE_TTL_MS)},
        )
        for i in range(2)
    ]
    envoy = envoy_over(gws, logs)
    try:
        yield envoy, gws
    finally:
        envoy.stop()
        for g in gws:
            g.stop()


def http(
    envoy: EnvoyProcess,
    method: str,
    path: str,
    body: dict[str, Any] | None = None,
    key: str = ADMIN_KEY,
) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(
        f"http://{envoy.listener_address()}{path}",
        method=method,
        data=json.dumps(body).encode() if body is not None else None,
        headers={"authorization": f"Bearer {key}", "content-type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def stream(envoy: EnvoyProcess, key: str, text: str = "Say hi", max_tokens: int = 4) -> list[Any]:
    with grpc.insecure_channel(envoy.listener_address()) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        return list(
            stub.Generate(
                chat(text, max_tokens), metadata=(("authorization", f"Bearer {key}"),), timeout=60
            )
        )


def test_admin_over_http_json_then_a_tenant_streams_and_new_limits_apply(
    edge: tuple[EnvoyProcess, list[GatewayProcess]],
) -> None:
    envoy, _ = edge
    code, tenant = http(
        envoy,
        "PUT",
        "/v1/admin/tenants/e2e-team",
        {"limits": {"requests_per_minute": 100, "max_concurrent": 4}, "priority": "CRITICAL"},
    )
    assert code == 200, tenant
    assert tenant["priority"] == "CRITICAL"
    code, created = http(envoy, "POST", "/v1/admin/tenants/e2e-team/keys", {"name": "e2e"})
    assert code == 200, created
    key = created["key"]

    chunks = stream(envoy, key)
    assert chunks[-1].finish_reason in (common_pb2.STOP, common_pb2.LENGTH)
    assert "".join(c.text for c in chunks)
    code, usage = http(envoy, "GET", "/v1/admin/tenants/e2e-team/usage")
    assert code == 200
    assert int(usage["requests_total"]) == 1
    assert int(usage["completion_tokens_total"]) == chunks[-1].usage.completion_tokens

    # tighten the limit over HTTP; once every replica's tenant cache has seen it (the
    # bounded staleness across gateway replicas), the next request over it is refused
    # (a PATCH changes only the masked fields: priority and concurrency stay)
    budget = {"name": "daily", "metric": "BUDGET_TOKENS", "period": "BUDGET_DAY", "limit": 10**6}
    code, patched = http(
        envoy,
        "PATCH",
        "/v1/admin/tenants/e2e-team?update_mask=limits.requests_per_minute,"
        "limits.request_burst,budgets",
        {"limits": {"requests_per_minute": 1, "request_burst": 1}, "budgets": [budget]},
    )
    assert code == 200, patched
    assert patched["priority"] == "CRITICAL"
    assert patched["limits"]["max_concurrent"] == 4
    assert patched["budgets"][0]["name"] == "daily"
    time.sleep(CACHE_TTL_MS / 1000 + 0.2)
    code, _ = http(envoy, "POST", "/v1/admin/tenants/e2e-team/reset", {})
    assert code == 200
    stream(envoy, key)  # the one request the new burst allows
    with pytest.raises(grpc.RpcError) as err:
        stream(envoy, key)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert int(trailers(err.value)["retry-after-ms"]) > 0


def test_admin_http_errors_map_to_http_codes(
    edge: tuple[EnvoyProcess, list[GatewayProcess]],
) -> None:
    envoy, _ = edge
    assert http(envoy, "GET", "/v1/admin/tenants/no-such-tenant")[0] == 404
    assert http(envoy, "GET", "/v1/admin/tenants", key="sk-llm-" + "x" * 40)[0] == 401


def test_a_stopped_gateway_replica_is_routed_around(
    edge: tuple[EnvoyProcess, list[GatewayProcess]],
) -> None:
    envoy, gws = edge
    _, key = gws[0].tenant(requests_per_minute=1000)
    gws[0].proc.stop()  # SIGTERM: drains, then exits
    for _ in range(4):  # every request lands on the survivor (health checks + retries)
        chunks = stream(envoy, key, max_tokens=2)
        assert chunks[-1].usage.completion_tokens == 2
