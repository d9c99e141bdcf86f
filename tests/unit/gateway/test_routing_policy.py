"""Routing policy values: validation, JSON form, sticky buckets, weighted picks, config."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from common.config import load_config
from gateway.config import GatewayConfig
from gateway.routing_policy import (
    GuardPolicy,
    RoutingPolicy,
    bucket,
    from_dict,
    pick_version,
    policies_from_config,
)


def canary(weights: dict[str, int], **kw: object) -> RoutingPolicy:
    return RoutingPolicy(model="m", stable_version="v1", weights=weights, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"weights": {}}, "positive sum"),
        ({"weights": {"v1": -1, "v2": 5}}, "positive sum"),
        ({"sticky": "cookie"}, "sticky must be one of"),
        ({"shadow_percent": 101.0}, "shadow percent"),
        ({"guard": GuardPolicy(max_ttft_p95_ratio=0.5)}, "guard needs"),
        ({"stable_version": ""}, "stable_version is empty"),
    ],
)
def test_invalid_policies_name_the_problem(kw: dict[str, object], match: str) -> None:
    args: dict[str, object] = {"model": "m", "stable_version": "v1", "weights": {"v1": 1}, **kw}
    with pytest.raises(ValueError, match=match):
        RoutingPolicy(**args)  # type: ignore[arg-type]


def test_json_round_trip_and_unknown_keys() -> None:
    p = canary(
        {"v1": 95, "v2": 5},
        tenant_pins={"beta": "v2"},
        sticky="tenant",
        shadow_version="v3",
        shadow_percent=10.0,
        guard=GuardPolicy(enabled=True),
    )
    assert from_dict(p.to_dict()) == p
    with pytest.raises(ValueError, match="unknown key"):
        from_dict({"stable_version": "v1", "weights": {"v1": 1}, "weigths": {}}, "m")


def test_states_percent_and_candidates() -> None:
    p = canary({"v1": 90, "v2": 10, "old": 0}, shadow_version="v3", shadow_percent=5.0)
    assert p.routed_versions() == ["v2", "v1"]  # stable last
    assert p.percent("v2") == pytest.approx(10.0)
    assert [p.state(v) for v in ("v1", "v2", "v3", "old")] == [
        "stable",
        "canary",
        "shadow",
        "draining",
    ]
    assert p.candidates() == ["v2", "v3"]


def test_sticky_keys_keep_their_version_and_raising_the_canary_only_moves_stable_keys() -> None:
    rng = random.Random(0)
    keys = [f"session-{i}" for i in range(300)]
    at5 = {k: pick_version(canary({"v1": 95, "v2": 5}), k, rng) for k in keys}
    again = {k: pick_version(canary({"v1": 95, "v2": 5}), k, rng) for k in keys}
    assert at5 == again
    at20 = {k: pick_version(canary({"v1": 80, "v2": 20}), k, rng) for k in keys}
    assert all(at20[k] == "v2" for k in keys if at5[k] == "v2")  # canary users stay
    assert sum(v == "v2" for v in at20.values()) > sum(v == "v2" for v in at5.values())
    assert 0 <= bucket("m", "x") < 10_000


def test_config_takes_yaml_mapping_or_json_string() -> None:
    body = {
        "stable_version": "v1",
        "weights": {"v1": 95, "v2": 5},
        "guard": {"enabled": True, "min_requests": 50},
    }
    cfg = GatewayConfig(routing_policies={"m": body})
    assert policies_from_config(cfg.routing_policies)["m"].guard.min_requests == 50
    cfg = GatewayConfig(routing_policies='{"m": {"stable_version": "v1", "weights": {"v1": 1}}}')  # type: ignore[arg-type]
    assert policies_from_config(cfg.routing_policies)["m"].weights == {"v1": 1}
    with pytest.raises(ValueError, match="routing policy of 'm'"):
        GatewayConfig(routing_policies={"m": {"stable_version": "v1", "weights": {}}})


def test_stack_yaml_section_with_a_nested_policy(tmp_path: Path) -> None:
    path = tmp_path / "stack.yaml"
    path.write_text(
        "gateway:\n"
        "  routing_policy_cache_ms: 250\n"
        "  routing_policies:\n"
        "    SmolLM2-135M-Instruct:\n"
        "      stable_version: v1\n"
        "      weights: {v1: 95, v2: 5}\n"
        "      tenant_pins: {beta-team: v2}\n"
        "      sticky: session\n"
        "      guard: {enabled: true, min_requests: 50, max_error_rate_increase: 0.02}\n"
    )
    cfg = load_config(GatewayConfig, "gateway", path=path, env={})
    (policy,) = policies_from_config(cfg.routing_policies).values()
    assert policy.percent("v2") == pytest.approx(5.0)
    assert policy.tenant_pins == {"beta-team": "v2"}
    assert cfg.routing_policy_cache_ms == 250
