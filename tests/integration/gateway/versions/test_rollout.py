"""Model versions through a real gateway: weights, pins, stickiness, shadow, rollback,
guard (the gateway and its replicas: ``conftest``)."""

from __future__ import annotations

import concurrent.futures as cf
import math
import random
from typing import Any

import grpc
import pytest

from gateway.release.version_router import sticky_key
from gateway.routing_policy import RoutingPolicy, pick_version
from llm.v1 import admin_pb2, engine_pb2, gateway_pb2
from tests.integration.gateway.conftest import (
    GatewayProcess,
    chat,
)
from tests.integration.gateway.versions.conftest import (
    BROKEN,
    CANARY,
    FailingEngine,
    served_version,
    set_policy,
    wait_for,
)

pytestmark = pytest.mark.integration


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
