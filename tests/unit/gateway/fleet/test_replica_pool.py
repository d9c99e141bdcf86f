"""Replica choice: score, skips, tie-breaks and the explanation when none can serve."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.breaker import BreakerPolicy
from gateway.fleet.replica_pool import NoReplicaError, ReplicaPool
from llm.v1 import engine_pb2

MODEL = "m"


@pytest.fixture
async def pool() -> AsyncIterator[ReplicaPool]:
    p = ReplicaPool(["a:1", "b:2", "c:3"], BreakerPolicy(consecutive_failures=1, open_s=60))
    for r in p.replicas:  # what the health watch and stats poll would have set
        r.healthy = True
        r.info = engine_pb2.ModelInfo(model=MODEL, version="v1", max_context_length=2048)
        r.stats = engine_pb2.EngineStats()
    try:
        yield p
    finally:
        await p.close()


async def test_least_loaded_weighted_by_queue_and_kv(pool: ReplicaPool) -> None:
    a, b, c = pool.replicas
    a.outstanding = 2
    b.stats = engine_pb2.EngineStats(num_waiting=3)
    c.stats = engine_pb2.EngineStats(kv_cache_usage=0.9)
    # scores: a (2+1)*1 = 3, b (3+1)*1 = 4, c (0+1)*1.9 = 1.9
    assert pool.choose(MODEL)[0] is c
    assert c.outstanding == 1
    c.release(True)


async def test_ties_go_to_the_least_recently_picked(pool: ReplicaPool) -> None:
    order = []
    for _ in range(6):
        r, ticket = pool.choose(MODEL)
        order.append(r.address)
        r.release(True, ticket)
    assert order == ["a:1", "b:2", "c:3", "a:1", "b:2", "c:3"]


async def test_skips_unhealthy_draining_open_excluded_and_other_versions(pool: ReplicaPool) -> None:
    a, b, c = pool.replicas
    a.healthy, a.last_error = False, "unreachable (UNAVAILABLE: connection refused)"
    b.stats = engine_pb2.EngineStats(draining=True)
    assert pool.choose(MODEL)[0] is c
    c.release(False)  # one failure opens c's breaker (consecutive_failures=1)
    with pytest.raises(NoReplicaError) as info:
        pool.choose(MODEL)
    text = str(info.value)
    assert "a:1 unhealthy: unreachable" in text
    assert "b:2 draining" in text
    assert "c:3 circuit open" in text
    b.stats = engine_pb2.EngineStats()
    assert pool.choose(MODEL, exclude=["c:3"])[0] is b
    b.release(None)
    with pytest.raises(NoReplicaError, match="already tried"):
        pool.choose(MODEL, exclude=["b:2"])
    with pytest.raises(NoReplicaError, match="runs version 'v1'"):
        pool.choose(MODEL, version="v2")


async def test_catalog_and_default_model(pool: ReplicaPool) -> None:
    pool.replicas[2].info = engine_pb2.ModelInfo(model="other", version="x", max_context_length=512)
    assert pool.default_model() == MODEL
    entries = {e.model: e for e in pool.catalog()}
    assert entries[MODEL].versions == {"v1": (2, 2)}
    assert entries["other"].max_context_length == 512
    info = pool.model_info(MODEL)
    assert info is not None
    assert info.max_context_length == 2048
    assert pool.model_info("nope") is None


def sharded_pool(n: int, k: int) -> ReplicaPool:
    p = ReplicaPool([f"e{i}:1" for i in range(n)], BreakerPolicy(), tenant_shard_size=k)
    for r in p.replicas:
        r.healthy = True
        r.info = engine_pb2.ModelInfo(model=MODEL, version="v1", max_context_length=2048)
        r.stats = engine_pb2.EngineStats()
    return p


async def test_a_tenants_flood_stays_on_its_shard_while_others_spread() -> None:
    p = sharded_pool(6, 2)
    try:
        flood = p.shard(MODEL, "", "flood")
        assert flood is not None
        assert len(flood) == 2
        held = [p.choose(MODEL, tenant="flood")[0] for _ in range(30)]  # none released
        assert {r.address for r in held} == flood  # 15 each on its 2, none elsewhere
        assert max(r.outstanding for r in held) == 15
        # another tenant's shard differs; where it overlaps, the least loaded wins
        other = next(t for t in (f"t{i}" for i in range(100)) if p.shard(MODEL, "", t) != flood)
        r, _ = p.choose(MODEL, tenant=other)
        assert r.address not in flood
        assert r.outstanding == 1
        # without a tenant (or with the shard off) every replica is a candidate
        assert p.choose(MODEL)[0].address not in flood
    finally:
        await p.close()


async def test_a_shard_spills_only_when_none_of_it_can_take_the_attempt() -> None:
    p = sharded_pool(4, 2)
    try:
        shard = p.shard(MODEL, "", "team")
        assert shard is not None
        first, second = sorted(shard)
        # its shard's queues full: the retry excludes both, so it goes elsewhere
        r, _ = p.choose(MODEL, exclude=[first, second], tenant="team")
        assert r.address not in shard
        # one shard replica down: the other takes it, however loaded
        by_addr = {x.address: x for x in p.replicas}
        by_addr[first].healthy = False
        by_addr[second].outstanding = 50
        assert p.choose(MODEL, tenant="team")[0].address == second
        # the shard is computed over healthy and unhealthy replicas: it did not move
        assert p.shard(MODEL, "", "team") == shard
    finally:
        await p.close()


@settings(max_examples=50, deadline=None)
@given(
    n=st.integers(2, 12),
    k=st.integers(1, 4),
    tenants=st.lists(st.text(min_size=1, max_size=8), min_size=1, max_size=20, unique=True),
)
def test_shards_are_stable_sized_and_move_little_when_a_replica_joins(
    n: int, k: int, tenants: list[str]
) -> None:
    """Every tenant gets min(k, n) replicas (None when that is all of them); adding a
    replica changes a tenant's shard only by letting the new replica into it."""

    async def run() -> None:
        before, after = sharded_pool(n, k), sharded_pool(n + 1, k)
        try:
            for t in tenants:
                a, b = before.shard(MODEL, "", t), after.shard(MODEL, "", t)
                assert a == before.shard(MODEL, "", t)  # deterministic
                if n <= k:
                    assert a is None
                    continue
                assert a is not None
                assert b is not None
                assert len(a) == len(b) == k
                assert len(a - b) <= 1
                assert b - a <= {f"e{n}:1"}
        finally:
            await before.close()
            await after.close()

    asyncio.run(run())
