"""Version routing with the real router, policy cache and replica pool (fake replica state)."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import AsyncIterator

import pytest

from common.breaker import BreakerPolicy
from gateway.fleet.replica_pool import NoReplicaError, ReplicaPool
from gateway.fronts.grpc_servicer import models_to_proto
from gateway.release.policy_store import MemoryPolicyStore, PolicyCache
from gateway.release.version_router import VersionRouter
from gateway.release.version_stats import VersionStats
from gateway.routing_policy import RoutingPolicy
from llm.v1 import engine_pb2

MODEL = "m"


@pytest.fixture
async def pool() -> AsyncIterator[ReplicaPool]:
    p = ReplicaPool(["a:1", "b:2", "c:3"], BreakerPolicy(consecutive_failures=1, open_s=60))
    for r, version in zip(p.replicas, ("v1", "v1", "v2"), strict=True):
        r.healthy = True
        r.info = engine_pb2.ModelInfo(model=MODEL, version=version, max_context_length=2048)
        r.stats = engine_pb2.EngineStats()
    try:
        yield p
    finally:
        await p.close()


async def router_with(
    pool: ReplicaPool, policy: RoutingPolicy | None
) -> tuple[VersionRouter, VersionStats]:
    store = MemoryPolicyStore()
    if policy is not None:
        store.policies[MODEL] = policy
    stats = VersionStats()
    return VersionRouter(PolicyCache(store, ttl_s=60), pool, stats, random.Random(7)), stats


def policy(weights: dict[str, int], **kw: object) -> RoutingPolicy:
    return RoutingPolicy(model=MODEL, stable_version="v1", weights=weights, **kw)  # type: ignore[arg-type]


async def route(
    router: VersionRouter, pool: ReplicaPool, tenant: str = "t", session: str = ""
) -> str:
    d = await router.decide(MODEL, "", tenant, session)
    replica, ticket = pool.choose(MODEL, d.version, (), d.fallbacks)
    replica.release(True, ticket)
    assert replica.info is not None
    return replica.info.version


async def test_weights_80_20_hold_over_200_decisions(pool: ReplicaPool) -> None:
    router, _ = await router_with(pool, policy({"v1": 80, "v2": 20}, sticky="none"))
    counts = Counter([await route(router, pool) for _ in range(200)])
    # binomial(200, 0.2): mean 40, sd 5.7; +-3.5 sd
    assert 20 <= counts["v2"] <= 60, counts
    assert counts["v1"] + counts["v2"] == 200


async def test_no_policy_means_any_version_and_requested_version_is_strict(
    pool: ReplicaPool,
) -> None:
    router, _ = await router_with(pool, None)
    d = await router.decide(MODEL, "", "t")
    assert (d.version, d.fallbacks, d.reason) == ("", (), "any")
    router, _ = await router_with(pool, policy({"v1": 100}))
    d = await router.decide(MODEL, "v2", "t")
    assert (d.version, d.fallbacks, d.reason) == ("v2", (), "request")


async def test_pins_and_sticky_sessions_and_tenants(pool: ReplicaPool) -> None:
    router, _ = await router_with(pool, policy({"v1": 50, "v2": 50}, tenant_pins={"beta": "v2"}))
    assert {await route(router, pool, tenant="beta") for _ in range(20)} == {"v2"}
    for s in ("conv-1", "conv-2", "conv-3", "conv-4"):
        assert len({await route(router, pool, session=s) for _ in range(10)}) == 1
    unsticky = {await route(router, pool) for _ in range(40)}
    assert unsticky == {"v1", "v2"}  # no session key: drawn by weight
    router, _ = await router_with(pool, policy({"v1": 50, "v2": 50}, sticky="tenant"))
    for tenant in ("t1", "t2", "t3"):
        assert (
            len({await route(router, pool, tenant=tenant, session=str(i)) for i in range(10)}) == 1
        )


async def test_unavailable_canary_falls_back_to_stable_and_counts_as_its_error(
    pool: ReplicaPool,
) -> None:
    router, stats = await router_with(pool, policy({"v1": 0, "v2": 100}))
    pool.replicas[2].healthy = False
    d = await router.decide(MODEL, "", "t")
    assert (d.version, d.fallbacks) == ("v2", ())  # v1 has weight 0: no fallback
    assert stats.summary(MODEL, "v2", 60).num_errors == 1
    router, stats = await router_with(pool, policy({"v1": 1, "v2": 99}))
    d = await router.decide(MODEL, "", "t", "s")
    assert d.version == "v2"
    assert d.fallbacks == ("v1",)
    replica, ticket = pool.choose(MODEL, d.version, (), d.fallbacks)
    assert replica.info is not None
    assert replica.info.version == "v1"
    replica.release(True, ticket)
    assert stats.summary(MODEL, "v2", 60).num_errors == 1
    with pytest.raises(NoReplicaError, match="c:3 unhealthy"):
        pool.choose(MODEL, "v2")


async def test_shadow_share_and_attempt_outcomes(pool: ReplicaPool) -> None:
    router, stats = await router_with(
        pool, policy({"v1": 100}, shadow_version="v2", shadow_percent=50.0)
    )
    shadows = [(await router.decide(MODEL, "", "t")).shadow_version for _ in range(100)]
    assert 25 <= shadows.count("v2") <= 75
    assert set(shadows) == {"", "v2"}
    router.on_attempt(pool.replicas[2], False, None)
    router.on_attempt(pool.replicas[0], True, 0.02)
    router.on_attempt(pool.replicas[0], None, None)  # neutral: not counted
    assert stats.summary(MODEL, "v2", 60).error_rate == 1.0
    assert stats.summary(MODEL, "v1", 60).num_requests == 1


async def test_list_models_shows_weights_and_states(pool: ReplicaPool) -> None:
    router, _ = await router_with(
        pool, policy({"v1": 95, "v2": 5}, shadow_version="v3", shadow_percent=10.0)
    )
    (card,) = models_to_proto(await router.annotate(pool.catalog())).models
    got = {v.version: (v.weight, v.state, v.num_replicas) for v in card.versions}
    assert got == {"v1": (95, "stable", 2), "v2": (5, "canary", 1), "v3": (0, "shadow", 0)}
