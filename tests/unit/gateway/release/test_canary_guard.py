"""Rollout operations and the canary guard over a memory policy store (fake clock stats)."""

from __future__ import annotations

import pytest

from gateway.release.canary_guard import CanaryGuard, judge
from gateway.release.policy_store import MemoryPolicyStore, PolicyCache
from gateway.release.rollout import GUARD_ACTOR, RolloutManager
from gateway.release.routing_admin import policy_from_proto, policy_to_proto
from gateway.release.version_stats import VersionStats
from gateway.routing_policy import GuardPolicy, RoutingPolicy
from ratelimit.errors import ConflictError, NotFoundError
from tests.support.clock import FakeClock

MODEL = "m"
GUARD = GuardPolicy(
    enabled=True, max_error_rate_increase=0.1, max_ttft_p95_ratio=1.5, min_requests=10, window_s=60
)


def canary(**kw: object) -> RoutingPolicy:
    args: dict[str, object] = {
        "model": MODEL,
        "stable_version": "v1",
        "weights": {"v1": 90, "v2": 10},
        "guard": GUARD,
        **kw,
    }
    return RoutingPolicy(**args)  # type: ignore[arg-type]


def feed(stats: VersionStats, version: str, n: int, errors: int, ttft: float) -> None:
    for i in range(n):
        stats.record(MODEL, version, ok=i >= errors, ttft_s=ttft)


def test_judge_error_rate_ttft_and_minimum() -> None:
    clock = FakeClock(1000.0)
    stats = VersionStats(clock)
    p = canary(updated_at=clock.now - 1)
    feed(stats, "v1", 40, 1, 0.10)
    feed(stats, "v2", 9, 9, 0.10)
    assert judge(p, stats) is None  # 9 < min_requests
    feed(stats, "v2", 1, 1, 0.10)
    why = judge(p, stats)
    assert why is not None
    assert "candidate 'v2': error rate 100.0%" in why
    stats = VersionStats(clock)
    feed(stats, "v1", 40, 0, 0.10)
    feed(stats, "v2", 20, 0, 0.40)
    why = judge(p, stats)
    assert why is not None
    assert "p95 TTFT 400 ms" in why
    stats.forget(MODEL, "v2")
    feed(stats, "v2", 20, 1, 0.12)  # 5% errors, +20% TTFT: within the margins
    assert judge(p, stats) is None


def test_judge_counts_only_samples_since_the_policy_changed() -> None:
    clock = FakeClock(1000.0)
    stats = VersionStats(clock)
    feed(stats, "v2", 20, 20, 0.1)
    clock.advance(5)
    assert judge(canary(updated_at=clock.now - 1), stats) is None
    assert judge(canary(updated_at=clock.now - 10), stats) is not None


async def test_rollout_set_cas_rollback_promote_delete() -> None:
    store = MemoryPolicyStore()
    rollout = RolloutManager(PolicyCache(store, ttl_s=60), audit=None)
    with pytest.raises(NotFoundError):
        await rollout.get(MODEL)
    p1 = await rollout.set(
        canary(tenant_pins={"beta": "v2", "legacy": "v0"}),
        expected=0,
        actor="k1",
        reason="canary 10%",
    )
    assert (p1.revision, p1.updated_by) == (1, "k1")
    with pytest.raises(ConflictError, match="revision 1, not 7"):
        await rollout.set_weights(MODEL, {"v1": 50, "v2": 50}, expected=7, actor="k1", reason="")
    p2 = await rollout.set_weights(MODEL, {"v1": 50, "v2": 50}, expected=1, actor="k1", reason="")
    assert p2.revision == 2
    assert p2.percent("v2") == 50
    p3 = await rollout.rollback(MODEL, reason="bad answers", actor="k2")
    assert dict(p3.weights) == {"v1": 100}
    assert dict(p3.tenant_pins) == {"legacy": "v0"}  # pins to the candidate are gone
    assert p3.last_rollback_reason == "bad answers"
    p4 = await rollout.promote(MODEL, "v2", actor="k1", reason="good")
    assert (p4.stable_version, dict(p4.weights)) == ("v2", {"v2": 100})
    assert await rollout.delete(MODEL, actor="k1", reason="") is True
    assert await rollout.delete(MODEL, actor="k1", reason="") is False


async def test_guard_rolls_back_once_and_yields_to_a_concurrent_change() -> None:
    store = MemoryPolicyStore()
    cache = PolicyCache(store, ttl_s=0)
    rollout = RolloutManager(cache, audit=None)
    stats = VersionStats()
    guard = CanaryGuard(cache, stats, rollout.auto_rollback, interval_s=60)
    await rollout.set(canary(), expected=0, actor="k1", reason="")
    assert await guard.check_once() == []
    feed(stats, "v2", 10, 10, 0.1)
    assert await guard.check_once() == [MODEL]
    p = await rollout.get(MODEL)
    assert dict(p.weights) == {"v1": 100}
    assert p.updated_by == GUARD_ACTOR
    assert p.last_rollback_reason.startswith("automatic: candidate 'v2': error rate")
    assert await guard.check_once() == []  # nothing left to judge

    async def racing(policy: RoutingPolicy, why: str) -> object:
        await rollout.set_weights(MODEL, {"v1": 1, "v2": 1}, expected=0, actor="k1", reason="")
        return await rollout.auto_rollback(policy, why)

    await rollout.set(canary(), expected=0, actor="k1", reason="")
    feed(stats, "v2", 10, 10, 0.1)
    assert await CanaryGuard(cache, stats, racing).check_once() == []


def test_proto_round_trip_and_defaults() -> None:
    p = canary(sticky="tenant", shadow_version="v3", shadow_percent=2.5, tenant_pins={"beta": "v2"})
    assert policy_from_proto(policy_to_proto(p)) == p.replace(updated_at=0.0)
    msg = policy_to_proto(p)
    msg.ClearField("guard")
    msg.guard.enabled = True
    assert policy_from_proto(msg).guard == GuardPolicy(enabled=True)
