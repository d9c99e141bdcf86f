"""Model versions through a real gateway: weights, pins, stickiness, shadow, rollback, guard.

Replicas behind the gateway of this module:

    the suite's EnginePair          version = the default (sha-<weights>)   "stable"
    gw-canary (real engine)         --model-version v2-canary               the candidate
    FailingEngine (this module)     version broken-canary-test-fixture      TEST FIXTURE:
                                    an in-process Engine that answers every Generate
                                    with UNAVAILABLE (a canary that cannot serve)

The gateway uses its own Redis key prefix, so its policies, tenants and audit
log are its own. Every test sets the policy it needs.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import math
import random
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health, health_pb2_grpc

from common.procs import ManagedProcess
from common.redis_server import RedisServer
from deploy.envoy import EnvoyProcess, render_config_file
from gateway.release.policy import RoutingPolicy, pick_version
from gateway.release.version_router import sticky_key
from llm.v1 import admin_pb2, admin_pb2_grpc, engine_pb2, engine_pb2_grpc, gateway_pb2
from llm_client import cli
from tests.conftest import engine_running
from tests.integration.gateway.conftest import (
    ADMIN_KEY,
    EnginePair,
    GatewayProcess,
    chat,
    start_gateway,
)

pytestmark = pytest.mark.integration
CANARY = "v2-canary"
BROKEN = "broken-canary-test-fixture"


class FailingEngine(engine_pb2_grpc.EngineServicer):
    """TEST FIXTURE: an engine replica configured to fail every Generate (UNAVAILABLE)."""

    def __init__(self, info: engine_pb2.ModelInfo) -> None:
        self.info = info
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        engine_pb2_grpc.add_EngineServicer_to_server(self, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), self.server)
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.num_generate = 0

    def GetModelInfo(self, request: Any, context: Any) -> engine_pb2.ModelInfo:
        return self.info

    def GetStats(self, request: Any, context: Any) -> engine_pb2.EngineStats:
        return engine_pb2.EngineStats()

    def GetTokenizer(self, request: Any, context: Any) -> Iterator[Any]:
        # its tokenizer is the stable engines' (same digest): the gateway holds it already
        context.abort(grpc.StatusCode.UNAVAILABLE, "test fixture: configured to fail")
        yield engine_pb2.TokenizerFilePiece()  # pragma: no cover

    def Generate(self, request: Any, context: Any) -> Iterator[Any]:
        self.num_generate += 1
        context.abort(grpc.StatusCode.UNAVAILABLE, "test fixture: configured to fail")
        yield engine_pb2.EngineGenerateResponse()  # pragma: no cover


def wait_for(what: str, check: Callable[[], bool], within_s: float = 30.0) -> None:
    end = time.monotonic() + within_s
    while not check():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


@pytest.fixture(scope="module")
def stable_info(engines: EnginePair) -> engine_pb2.ModelInfo:
    engines.ensure_running()
    with grpc.insecure_channel(engines.addresses[0]) as ch:
        info: engine_pb2.ModelInfo = engine_pb2_grpc.EngineStub(ch).GetModelInfo(
            engine_pb2.GetModelInfoRequest(), timeout=10
        )
    return info


@pytest.fixture(scope="module")
def canary_engine(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ManagedProcess]:
    with engine_running(
        "gw-canary",
        model_dir,
        tmp_path_factory.mktemp("gw-canary"),
        args=["--model-version", CANARY],
    ) as proc:
        yield proc


@pytest.fixture(scope="module")
def broken_engine(stable_info: engine_pb2.ModelInfo) -> Iterator[FailingEngine]:
    info = engine_pb2.ModelInfo()
    info.CopyFrom(stable_info)
    info.version = BROKEN
    fake = FailingEngine(info)
    fake.server.start()
    try:
        yield fake
    finally:
        fake.server.stop(None)


@pytest.fixture(scope="module")
def vgw(
    engines: EnginePair,
    stable_info: engine_pb2.ModelInfo,
    canary_engine: ManagedProcess,
    broken_engine: FailingEngine,
    tokenizer_server: ManagedProcess,
    gw_redis: RedisServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[GatewayProcess]:
    seeded = {
        stable_info.model: {
            "stable_version": stable_info.version,
            "weights": {stable_info.version: 100},
        }
    }
    env = {
        "LLM_RATELIMIT_KEY_PREFIX": "rv:",
        "LLM_GATEWAY_ROUTING_POLICY_CACHE_MS": "100",
        "LLM_GATEWAY_GUARD_INTERVAL_S": "0.2",
        "LLM_GATEWAY_RETRY_BUDGET_MIN": "50",
        "LLM_GATEWAY_ROUTING_POLICIES": json.dumps(seeded),
    }
    gw = start_gateway(
        "gateway-versions",
        [*engines.addresses, canary_engine.address, broken_engine.address],
        tokenizer_server.address,
        gw_redis.url,
        tmp_path_factory.mktemp("gateway-versions"),
        env,
    )
    try:
        yield gw
    finally:
        gw.stop()


@pytest.fixture(scope="module")
def routing(vgw: GatewayProcess) -> admin_pb2_grpc.RoutingAdminStub:
    return admin_pb2_grpc.RoutingAdminStub(vgw.channel)


@pytest.fixture(scope="module")
def model(vgw: GatewayProcess, stable_info: engine_pb2.ModelInfo) -> str:
    _, key = vgw.tenant()

    def all_healthy() -> bool:
        cards = vgw.stub.ListModels(
            gateway_pb2.ListModelsRequest(), metadata=(("authorization", f"Bearer {key}"),)
        )
        return sum(v.num_healthy_replicas for c in cards.models for v in c.versions) == 4

    wait_for("4 healthy replicas", all_healthy)
    return stable_info.model


def set_policy(
    vgw: GatewayProcess, routing: admin_pb2_grpc.RoutingAdminStub, policy: admin_pb2.RoutingPolicy
) -> admin_pb2.RoutingPolicy:
    out: admin_pb2.RoutingPolicy = routing.SetRoutingPolicy(policy, metadata=vgw.admin_md)
    return out


def served_version(
    vgw: GatewayProcess, key: str, session: str = "", req: gateway_pb2.GenerateRequest | None = None
) -> str:
    md = (("x-session-id", session),) if session else ()
    chunks = vgw.generate(key, req or chat("Hi", max_tokens=2), metadata=md)
    assert chunks[-1].finish_reason != 0
    return chunks[0].model_version


def test_seeded_policy_and_list_models(
    vgw: GatewayProcess, routing: Any, model: str, stable_info: engine_pb2.ModelInfo
) -> None:
    policy = routing.GetRoutingPolicy(
        admin_pb2.GetRoutingPolicyRequest(model=model), metadata=vgw.admin_md
    )
    assert policy.updated_by == "config"
    assert policy.stable_version == stable_info.version
    set_policy(
        vgw,
        routing,
        admin_pb2.RoutingPolicy(
            model=model,
            stable_version=stable_info.version,
            weights={stable_info.version: 95, CANARY: 5},
            shadow=admin_pb2.ShadowPolicy(version=BROKEN, percent=0),
        ),
    )
    _, key = vgw.tenant()
    (card,) = vgw.stub.ListModels(
        gateway_pb2.ListModelsRequest(), metadata=(("authorization", f"Bearer {key}"),)
    ).models
    got = {v.version: (v.weight, v.state, v.num_replicas) for v in card.versions}
    assert got == {
        stable_info.version: (95, "stable", 2),
        CANARY: (5, "canary", 1),
        BROKEN: (0, "draining", 1),
    }


def test_weights_and_session_stickiness(
    vgw: GatewayProcess, routing: Any, model: str, stable_info: engine_pb2.ModelInfo
) -> None:
    stable = stable_info.version
    set_policy(
        vgw,
        routing,
        admin_pb2.RoutingPolicy(
            model=model,
            stable_version=stable,
            weights={stable: 80, CANARY: 20},
            sticky=admin_pb2.STICKY_SESSION,
        ),
    )
    local = RoutingPolicy(model=model, stable_version=stable, weights={stable: 80, CANARY: 20})
    rng = random.Random(0)
    expected = {
        f"conv-{i}": pick_version(local, sticky_key(local, "", f"conv-{i}"), rng) for i in range(12)
    }
    assert set(expected.values()) == {stable, CANARY}  # both sides of the 80/20 split
    _, key = vgw.tenant()
    before = vgw.metric("gateway_requests_total", code="OK", version=CANARY)
    for session, version in expected.items():
        assert served_version(vgw, key, session) == version, session
    assert served_version(vgw, key, "conv-0") == expected["conv-0"]  # again: same version
    num_canary = sum(v == CANARY for v in expected.values()) + (expected["conv-0"] == CANARY)
    after = vgw.metric("gateway_requests_total", code="OK", version=CANARY)
    assert after - before == num_canary


def test_weights_hold_statistically_over_a_few_hundred_real_requests(
    vgw: GatewayProcess, routing: Any, model: str, stable_info: engine_pb2.ModelInfo
) -> None:
    """80/20 without stickiness: the canary's share of 240 real requests is within
    4.5 standard deviations of 20% (a false alarm about once in 150,000 runs)."""
    stable = stable_info.version
    set_policy(
        vgw,
        routing,
        admin_pb2.RoutingPolicy(
            model=model,
            stable_version=stable,
            weights={stable: 80, CANARY: 20},
            sticky=admin_pb2.STICKY_NONE,
        ),
    )
    _, key = vgw.tenant()
    n = 240
    with cf.ThreadPoolExecutor(8) as pool:
        versions = list(
            pool.map(
                lambda i: served_version(vgw, key, req=chat(f"Hi {i}", max_tokens=1)), range(n)
            )
        )
    assert set(versions) == {stable, CANARY}
    num_canary = versions.count(CANARY)
    sd = math.sqrt(n * 0.2 * 0.8)
    assert abs(num_canary - 0.2 * n) <= 4.5 * sd, f"{num_canary} of {n} went to the canary"


def test_tenant_pin_explicit_version_and_tenant_stickiness(
    vgw: GatewayProcess, routing: Any, model: str, stable_info: engine_pb2.ModelInfo
) -> None:
    stable = stable_info.version
    pinned, pinned_key = vgw.tenant()
    _, other_key = vgw.tenant()
    set_policy(
        vgw,
        routing,
        admin_pb2.RoutingPolicy(
            model=model, stable_version=stable, weights={stable: 100}, tenant_pins={pinned: CANARY}
        ),
    )
    assert {served_version(vgw, pinned_key) for _ in range(3)} == {CANARY}
    assert served_version(vgw, other_key) == stable
    explicit = chat("Hi", max_tokens=2)
    explicit.model_version = CANARY
    assert served_version(vgw, other_key, req=explicit) == CANARY
    set_policy(
        vgw,
        routing,
        admin_pb2.RoutingPolicy(
            model=model,
            stable_version=stable,
            weights={stable: 50, CANARY: 50},
            sticky=admin_pb2.STICKY_TENANT,
        ),
    )
    assert len({served_version(vgw, other_key, session=f"s{i}") for i in range(3)}) == 1


def test_shadow_copy_is_recorded_and_never_reaches_the_client_or_the_bill(
    vgw: GatewayProcess, routing: Any, model: str, stable_info: engine_pb2.ModelInfo
) -> None:
    stable = stable_info.version
    set_policy(
        vgw,
        routing,
        admin_pb2.RoutingPolicy(
            model=model,
            stable_version=stable,
            weights={stable: 100},
            shadow=admin_pb2.ShadowPolicy(version=CANARY, percent=100),
        ),
    )
    tid, key = vgw.tenant()
    before = vgw.metric("gateway_shadow_requests_total", version=CANARY, code="OK")
    chunks = vgw.generate(key, chat("Name a color.", max_tokens=6, temperature=0))
    assert {c.model_version for c in chunks if c.model_version} == {stable}
    wait_for(
        "the shadow call",
        lambda: (
            vgw.metric("gateway_shadow_requests_total", version=CANARY, code="OK") == before + 1
        ),
    )
    usage = chunks[-1].usage
    wait_for("settlement", lambda: vgw.usage(tid).completion_tokens_total > 0)
    billed = vgw.usage(tid)
    assert billed.requests_total == 1
    assert billed.completion_tokens_total == usage.completion_tokens  # charged once
    assert billed.prompt_tokens_total == usage.prompt_tokens


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


def test_rollback_applies_to_the_next_request_while_a_stream_on_the_old_version_finishes(
    vgw: GatewayProcess, routing: Any, model: str, stable_info: engine_pb2.ModelInfo
) -> None:
    stable = stable_info.version
    set_policy(
        vgw,
        routing,
        admin_pb2.RoutingPolicy(
            model=model, stable_version=stable, weights={stable: 0, CANARY: 100}
        ),
    )
    _, key = vgw.tenant()
    stream = iter(
        vgw.stub.Generate(
            chat("Count to fifty.", max_tokens=48, min_tokens=48),
            metadata=(("authorization", f"Bearer {key}"),),
            timeout=120,
        )
    )
    first = next(stream)
    assert first.model_version == CANARY
    rolled = routing.Rollback(
        admin_pb2.RollbackRequest(model=model, reason="test rollback"), metadata=vgw.admin_md
    )
    assert dict(rolled.weights) == {stable: 100}
    assert served_version(vgw, key) == stable  # the next request follows the rollback
    rest = list(stream)
    assert rest[-1].finish_reason == 2  # LENGTH: the canary stream ran to its end
    assert rest[-1].usage.completion_tokens == 48
    events = vgw.admin.ListAuditEvents(
        admin_pb2.ListAuditEventsRequest(limit=1), metadata=vgw.admin_md
    ).events
    assert events[0].action == "Rollback"


def test_guard_rolls_back_a_failing_candidate_without_client_errors(
    vgw: GatewayProcess,
    routing: Any,
    model: str,
    broken_engine: FailingEngine,
    stable_info: engine_pb2.ModelInfo,
) -> None:
    stable = stable_info.version
    set_policy(
        vgw,
        routing,
        admin_pb2.RoutingPolicy(
            model=model,
            stable_version=stable,
            weights={stable: 50, BROKEN: 50},
            sticky=admin_pb2.STICKY_NONE,
            guard=admin_pb2.CanaryGuard(enabled=True, min_requests=3, max_error_rate_increase=0.2),
        ),
    )
    _, key = vgw.tenant()

    def rolled_back() -> bool:
        p = routing.GetRoutingPolicy(
            admin_pb2.GetRoutingPolicyRequest(model=model), metadata=vgw.admin_md
        )
        return dict(p.weights) == {stable: 100}

    served = []
    for _ in range(40):
        served.append(served_version(vgw, key))  # raises on any client error
        if rolled_back():
            break
    wait_for("the automatic rollback", rolled_back)
    assert set(served) == {stable}  # failed attempts fell back before the first token
    assert broken_engine.num_generate >= 1
    policy = routing.GetRoutingPolicy(
        admin_pb2.GetRoutingPolicyRequest(model=model), metadata=vgw.admin_md
    )
    assert policy.updated_by == "canary-guard"
    assert f"candidate '{BROKEN}': error rate" in policy.last_rollback_reason
    events = vgw.admin.ListAuditEvents(
        admin_pb2.ListAuditEventsRequest(limit=5), metadata=vgw.admin_md
    ).events
    assert any(e.action == "AutoRollback" and e.actor == "canary-guard" for e in events)
    assert vgw.metric("gateway_routing_rollbacks_total", trigger="guard") >= 1


def test_unknown_model_or_version_is_not_found_with_the_valid_names(
    vgw: GatewayProcess, model: str
) -> None:
    _, key = vgw.tenant()
    with pytest.raises(grpc.RpcError) as err:
        vgw.generate(key, gateway_pb2.GenerateRequest(model="no-such-model", prompt="x"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert model in (err.value.details() or "")
    req = chat("Hi", max_tokens=2)
    req.model_version = "v999"
    with pytest.raises(grpc.RpcError) as err:
        vgw.generate(key, req)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert CANARY in (err.value.details() or "")


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
