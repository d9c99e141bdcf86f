"""Replica choice: score, skips, tie-breaks and the explanation when none can serve."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

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
