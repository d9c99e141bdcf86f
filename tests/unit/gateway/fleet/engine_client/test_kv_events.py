"""KV events as a routing signal: the bounded per-replica prefix index, the subscription a
standard client keeps (resumed from its cursor after a disconnect, load records taken
as TrtllmService's stats) against a scripted TrtllmService on loopback gRPC, and the
pool preferring the replica that holds the prompt's prefix."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from prometheus_client import REGISTRY
from smg_grpc_proto.generated import common_pb2  # type: ignore[import-untyped]
from smg_grpc_proto.generated import (  # type: ignore[import-untyped]
    trtllm_service_pb2_grpc as pb_grpc,
)

from common.breaker import BreakerPolicy, CircuitBreaker
from gateway import metrics
from gateway.config import PREFIX_WEIGHT
from gateway.fleet.engine_client.kv_events import (
    PrefixIndex,
    PromptBlocks,
    prefix_discount,
)
from gateway.fleet.engine_client.standard import cache_salt
from gateway.fleet.engine_client.trtllm import TrtllmClient
from gateway.fleet.replica import Replica
from gateway.fleet.replica_pool import ReplicaPool
from llm.v1 import engine_pb2
from tests.unit.gateway.fleet.engine_client.scripted import serving, until
from tests.unit.gateway.fleet.engine_client.test_trtllm import ScriptedTrtllm

BS = 4


def stored(block_hash: int, tokens: list[int], parent: int | None = None, salt: str = "") -> Any:
    s = common_pb2.KvBlocksStored(
        blocks=[common_pb2.KvBlock(block_hash=block_hash, token_ids=tokens, block_size=BS)]
    )
    if parent is not None:
        s.parent_block_hash = parent
    if salt:
        s.cache_salt = salt
    return common_pb2.KvCacheEvent(stored=s)


def removed(*hashes: int) -> Any:
    return common_pb2.KvCacheEvent(removed=common_pb2.KvBlocksRemoved(block_hashes=hashes))


def batch(seq: int, *events: Any, load: Any = None) -> Any:
    b = common_pb2.KvEventBatch(sequence_number=seq, events=events)
    if load is not None:
        b.load.CopyFrom(load)
    return b


PROMPT = list(range(10))  # two full blocks of 4, and 2 more


def test_the_index_matches_whole_leading_blocks_of_its_chains() -> None:
    index = PrefixIndex()
    assert index.match(PromptBlocks(PROMPT), "") == 0
    index.apply(batch(3, stored(11, [0, 1, 2, 3]), stored(12, [4, 5, 6, 7], parent=11)))
    assert index.cursor == 4
    assert index.match(PromptBlocks(PROMPT), "") == 8
    assert index.match(PromptBlocks([0, 1, 2, 3, 9, 9, 9, 9]), "") == 4
    assert index.match(PromptBlocks([1, 2, 3, 4, 5, 6, 7, 8]), "") == 0  # not a chain start
    assert index.match(PromptBlocks(PROMPT), "salt") == 0  # another salt's chain
    index.apply(batch(4, removed(12)))
    assert index.match(PromptBlocks(PROMPT), "") == 4
    index.apply(batch(5, common_pb2.KvCacheEvent(cleared=common_pb2.KvCacheCleared())))
    assert (len(index), index.match(PromptBlocks(PROMPT), "")) == (0, 0)


def test_a_salted_chain_matches_only_its_salt_and_an_unknown_parent_is_skipped() -> None:
    index = PrefixIndex()
    index.apply(batch(1, stored(21, [0, 1, 2, 3], salt="7"), stored(22, [4, 5, 6, 7], parent=21)))
    index.apply(batch(2, stored(23, [8, 9, 10, 11], parent=999)))  # chain unknown here
    lora = stored(24, [0, 1, 2, 3])
    lora.stored.blocks[0].lora_id = 5  # an adapter's block: no request of ours hits it
    index.apply(batch(3, lora))
    assert len(index) == 2
    assert index.match(PromptBlocks(PROMPT), "7") == 8
    assert index.match(PromptBlocks(PROMPT), "") == 0


def test_the_index_keeps_at_most_its_cap_dropping_the_oldest() -> None:
    index = PrefixIndex(max_blocks=3)
    parent = None
    for i in range(6):
        index.apply(batch(i + 1, stored(100 + i, [i] * BS, parent=parent)))
        parent = 100 + i
    assert len(index) == 3
    chain = [t for i in range(6) for t in [i] * BS]
    assert index.match(PromptBlocks(chain), "") == 0  # the chain's head was dropped


def test_the_discount_rewards_the_share_of_the_prompt_held() -> None:
    assert prefix_discount(0, 100) == 1.0
    assert prefix_discount(50, 100) == pytest.approx(1 - PREFIX_WEIGHT / 2)
    assert prefix_discount(100, 100) == pytest.approx(1 - PREFIX_WEIGHT)
    assert prefix_discount(5, 0) == 1.0
    assert prefix_discount(100, 100, weight=0.0) == 1.0  # the gateway's prefix_weight 0
    assert prefix_discount(50, 100, weight=0.8) == pytest.approx(0.6)


class KvScripted(ScriptedTrtllm):
    """A TrtllmService whose event stream is scripted: each subscription takes the next
    list of batches (then ends, as a dropped connection does), the last one hangs."""

    def __init__(self) -> None:
        super().__init__()
        self.subscriptions: list[Any] = []
        self.streams: list[list[Any]] = []

    async def SubscribeKvEvents(self, request: Any, context: Any) -> AsyncIterator[Any]:
        self.subscriptions.append(request)
        n = len(self.subscriptions)
        for b in self.streams[n - 1] if n <= len(self.streams) else []:
            yield b
        if n >= len(self.streams):
            await asyncio.sleep(60)


@pytest.fixture
async def kv_engine() -> AsyncIterator[tuple[KvScripted, TrtllmClient, str]]:
    add = pb_grpc.add_TrtllmServiceServicer_to_server
    async with serving(add, KvScripted(), lambda a: TrtllmClient(a, poll_interval_s=0.02)) as e:
        yield e[0], e[1], e[1].address


async def test_the_client_follows_resumes_and_takes_the_load(
    kv_engine: tuple[KvScripted, TrtllmClient, str],
) -> None:
    servicer, client, _ = kv_engine
    salt = str(cache_salt("tenant:a"))  # as the client sends it, cache_salt_id
    load = common_pb2.EngineLoad(
        running_requests=3, waiting_requests=2, token_usage=0.25, max_running_requests=8
    )
    servicer.streams = [
        [batch(5, stored(31, [0, 1, 2, 3], salt=salt), stored(32, [4, 5, 6, 7], parent=31))],
        [batch(6, removed(32), load=load)],
    ]
    await client.model_info(timeout_s=5)
    assert (await client.stats(timeout_s=5)).max_num_seqs == 64  # no record yet
    health = client.watch_health()
    assert await anext(health) == ""  # the replica's watch starts the subscription
    mine = PromptBlocks(PROMPT, "tenant:a")
    await until("the resumed stream's removal", lambda: client.cached_tokens(mine) == 4)
    first, resumed = servicer.subscriptions[:2]
    assert first.start_sequence_number == 0
    assert first.load_records_before_first_batch
    assert resumed.start_sequence_number == 6  # after the last batch it had
    assert client.cached_tokens(PromptBlocks(PROMPT, "tenant:b")) == 0
    assert client.cached_tokens(PromptBlocks(PROMPT)) == 0
    stats = await client.stats(timeout_s=5)
    assert (stats.num_running, stats.num_waiting, stats.max_num_seqs) == (3, 2, 8)
    assert stats.kv_cache_usage == pytest.approx(0.25)
    await health.aclose()


async def test_the_pool_prefers_the_replica_holding_the_prompt(
    kv_engine: tuple[KvScripted, TrtllmClient, str],
) -> None:
    servicer, holder, address = kv_engine
    servicer.streams = [[batch(1, stored(41, [0, 1, 2, 3]), stored(42, [4, 5, 6, 7], parent=41))]]
    health = holder.watch_health()
    await anext(health)
    await until("the events", lambda: holder.cached_tokens(PromptBlocks(PROMPT)) == 8)
    other = TrtllmClient(address, poll_interval_s=0.02)  # the same engine, no events followed
    pool = ReplicaPool([], BreakerPolicy())
    info = engine_pb2.ModelInfo(model="m")
    for name, client in (("trtllm://a:1", other), ("trtllm://b:1", holder)):
        r = Replica(name, CircuitBreaker(name, BreakerPolicy()), 1.0, client=client)
        r.healthy, r.info = True, info
        pool.replicas.append(r)
    try:
        chosen, _ = pool.choose("m", prompt=PromptBlocks(PROMPT))
        assert chosen.address == "trtllm://b:1"
        chosen.release(True)
        plain, _ = pool.choose("m")
        assert plain.address == "trtllm://a:1"  # no prompt: the least recently picked
        plain.release(True)
        plain, _ = pool.choose("m")
        assert plain.address == "trtllm://b:1"  # a was picked last
        plain.release(True)
        pool.prefix_weight = 0.0  # the gateway's prefix_weight 0: the cache is ignored
        plain, _ = pool.choose("m", prompt=PromptBlocks(PROMPT))
        assert plain.address == "trtllm://a:1"  # the least recently picked, not the holder
        plain.release(True)
        pool.prefix_weight = 0.5
        busy = pool.replicas[1]
        busy.outstanding = 2  # load beats the cache: 3 * 0.6 > 1
        assert pool.choose("m", prompt=PromptBlocks(PROMPT))[0].address == "trtllm://a:1"
    finally:
        await health.aclose()
        await other.close()


def index_gauge(replica: str) -> float | None:
    return REGISTRY.get_sample_value("gateway_prefix_index_blocks", {"replica": replica})


async def test_the_replica_reports_its_prefix_index_size_until_it_leaves(
    kv_engine: tuple[KvScripted, TrtllmClient, str],
) -> None:
    servicer, client, _ = kv_engine
    servicer.streams = [[batch(1, stored(51, [0, 1, 2, 3]), stored(52, [4, 5, 6, 7], parent=51))]]
    name = "trtllm://gauge:1"
    replica = Replica(name, CircuitBreaker(name, BreakerPolicy()), 0.02, client=client)
    replica.start()  # its health watch subscribes; its stats poll sets the gauge
    try:
        await until("the index's size on /metrics", lambda: index_gauge(name) == 2)
        assert client.prefix_blocks() == 2
    finally:
        await replica.close()
    metrics.forget_replica(name)
    assert index_gauge(name) is None  # no series left for a replica that is gone
