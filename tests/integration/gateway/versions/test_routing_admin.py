"""Managing model versions: the RoutingAdmin API's auth, validation, conflicts and audit,
the same API as HTTP/JSON through Envoy, and llm-client's commands (the gateway and its
replicas: ``conftest``). Runs after test_rollout.py, whose first test reads the policy
the gateway was seeded with."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from deploy.envoy import EnvoyProcess, render_config_file
from llm.v1 import admin_pb2, engine_pb2
from llm_client import cli
from tests.integration.gateway.conftest import (
    ADMIN_KEY,
    GatewayProcess,
)
from tests.integration.gateway.versions.conftest import (
    CANARY,
    set_policy,
)

pytestmark = pytest.mark.integration


def test_admin_auth_validation_conflicts_and_audit(
    vgw: GatewayProcess, routing: Any, model: str, stable_info: engine_pb2.ModelInfo
) -> None:
    stable = stable_info.version
    _, tenant_key = vgw.tenant()
    req = admin_pb2.GetRoutingPolicyRequest(model=model)
    for md, code in (
        ((), grpc.StatusCode.UNAUTHENTICATED),
        ((("authorization", f"Bearer {tenant_key}"),), grpc.StatusCode.PERMISSION_DENIED),
    ):
        with pytest.raises(grpc.RpcError) as err:
            routing.GetRoutingPolicy(req, metadata=md)
        assert err.value.code() == code
    with pytest.raises(grpc.RpcError) as err:
        routing.GetRoutingPolicy(
            admin_pb2.GetRoutingPolicyRequest(model="nope"), metadata=vgw.admin_md
        )
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as err:
        set_policy(
            vgw,
            routing,
            admin_pb2.RoutingPolicy(model=model, stable_version=stable, weights={stable: 0}),
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    current = set_policy(
        vgw,
        routing,
        admin_pb2.RoutingPolicy(
            model=model, stable_version=stable, weights={stable: 100}, reason="audit me"
        ),
    )
    with pytest.raises(grpc.RpcError) as err:
        routing.SetWeights(
            admin_pb2.SetWeightsRequest(
                model=model,
                weights={stable: 90, CANARY: 10},
                expected_revision=current.revision - 1,
            ),
            metadata=vgw.admin_md,
        )
    assert err.value.code() == grpc.StatusCode.ABORTED
    shifted = routing.SetWeights(
        admin_pb2.SetWeightsRequest(
            model=model,
            weights={stable: 90, CANARY: 10},
            expected_revision=current.revision,
            reason="canary 10%",
        ),
        metadata=vgw.admin_md,
    )
    assert shifted.revision == current.revision + 1
    events = vgw.admin.ListAuditEvents(
        admin_pb2.ListAuditEventsRequest(limit=5), metadata=vgw.admin_md
    ).events
    assert [(e.action, e.target) for e in events[:2]] == [
        ("SetWeights", f"model:{model}"),
        ("SetRoutingPolicy", f"model:{model}"),
    ]
    assert json.loads(events[0].detail)["reason"] == "canary 10%"
    assert events[0].actor == events[1].actor != ""


@pytest.fixture(scope="module")
def edge(vgw: GatewayProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real Envoy (deploy/envoy/envoy.yaml) in front of this module's gateway."""
    workdir = tmp_path_factory.mktemp("versions-envoy")
    config = render_config_file(
        workdir / "envoy.yaml",
        listener_host="127.0.0.1",
        plaintext=True,  # loopback; TLS is tested in test_tls_envoy.py
        listener_port=0,
        admin_port=0,
        gateway=[vgw.proc.address],
        admin=[vgw.proc.address],
        access_log_path=workdir / "access.log",
    )
    envoy = EnvoyProcess(config, log_dir=workdir)
    envoy.start(timeout=30)
    try:
        yield f"http://{envoy.listener_address()}"
    finally:
        envoy.stop()


def http_json(
    method: str, url: str, body: dict[str, Any] | None = None, auth: str = ""
) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(
        url,
        method=method,
        data=json.dumps(body).encode() if body is not None else None,
        headers={"content-type": "application/json", **({"authorization": auth} if auth else {})},
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def test_routing_admin_as_http_json_through_envoy(
    edge: str, vgw: GatewayProcess, model: str, stable_info: engine_pb2.ModelInfo
) -> None:
    stable = stable_info.version
    auth = dict(vgw.admin_md)["authorization"]
    base = f"{edge}/v1/admin/models/{model}"
    status, _ = http_json("GET", f"{base}/routing")
    assert status == 401
    status, policy = http_json(
        "PUT",
        f"{base}/routing",
        {
            "stable_version": stable,
            "weights": {stable: 90, CANARY: 10},
            "sticky": "STICKY_NONE",
            "reason": "canary via http",
        },
        auth,
    )
    assert status == 200, policy
    assert policy["weights"] == {stable: 90, CANARY: 10}
    status, rollout = http_json("GET", f"{base}/rollout", auth=auth)
    assert status == 200
    assert {v["version"]: v["weight_percent"] for v in rollout["versions"]}[CANARY] == 10
    status, rolled = http_json("POST", f"{base}/rollback", {"reason": "http rollback"}, auth)
    assert status == 200
    assert rolled["weights"] == {stable: 100}
    assert rolled["last_rollback_reason"] == "http rollback"


def test_the_client_cli_shifts_weights_rolls_back_and_promotes(
    vgw: GatewayProcess,
    model: str,
    stable_info: engine_pb2.ModelInfo,
    capsys: pytest.CaptureFixture[str],
) -> None:
    stable = stable_info.version
    # the gateway itself, on loopback: plaintext (the CLI speaks TLS unless told)
    base = [
        *("--address", vgw.proc.address, "--plaintext"),
        *("--admin-key", ADMIN_KEY, "--json", "admin"),
    ]

    def cli_json(*argv: str) -> dict[str, Any]:
        assert cli.main([*base, *argv]) == 0
        out: dict[str, Any] = json.loads(capsys.readouterr().out)
        return out

    shifted = cli_json("weights", model, f"{stable}=80", f"{CANARY}=20", "--reason", "cli 20%")
    assert shifted["weights"] == {stable: 80, CANARY: 20}
    status = cli_json("rollout", model)
    assert {v["version"] for v in status["versions"]} >= {stable, CANARY}
    rolled = cli_json("rollback", model, "--reason", "cli says no")
    assert rolled["weights"] == {stable: 100}
    promoted = cli_json("promote", model, stable, "--reason", "cli keeps stable")
    assert promoted["stableVersion"] == stable
    listed = cli_json("models")
    assert model in {p["model"] for p in listed["policies"]}
    # a malformed weight is refused before any call
    with pytest.raises(SystemExit):
        cli.main([*base, "weights", model, "v1:5"])
    assert "VERSION=WEIGHT" in capsys.readouterr().err
