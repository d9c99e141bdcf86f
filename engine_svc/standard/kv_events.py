"""SubscribeKvEvents (smg-grpc-proto common.proto) from this engine's prefix cache.

The engine core records each full block its prefix cache stores and each one it evicts
(``engine_svc.core.kv_events.KvEventLog``, bounded, recording only while someone
listens); this stream polls that log and sends what is new as ``KvEventBatch``es:

- a stored block: ``KvBlocksStored`` with the block's hash, its tokens, the block size,
  its parent's hash (none for the first block of a chain) and the cache salt the
  chain was started under, in the protocol's own terms (``wire_salt``); a subscriber
  hashes the tokens itself and folds the salt in, so it never needs the engine's hash
  function;
- an evicted block: ``KvBlocksRemoved`` with its hash;
- a gap (the subscriber resumed from a number the log no longer holds, or fell behind
  by more than it keeps): ``KvCacheCleared`` first, then what follows. The engine
  holds no snapshot: a new subscriber learns the blocks stored from its subscription
  on.

Every batch carries the engine's load (``EngineLoad``: running, waiting, KV usage, rate,
max running), and a ``load_only`` batch goes out when the load changed without an
event, or each ``HEARTBEAT_S`` while idle; with ``load_records_before_first_batch``
the first one (numbered 0) goes out at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from smg_grpc_proto.generated import common_pb2  # type: ignore[import-untyped]

from common.server import Context
from engine_svc.core.kv_events import KvEvent, KvEventLog
from engine_svc.standard.shared import StandardEngine, unimplemented
from engine_svc.stats import BackendStats

POLL_S = 0.05
HEARTBEAT_S = 1.0
MAX_EVENTS_PER_BATCH = 512
DEVICE = common_pb2.KV_CACHE_TIER_DEVICE
LOCAL = common_pb2.KV_CACHE_LOCALITY_LOCAL


def cache_events(
    events: list[KvEvent], block_size: int, wire_salt: Callable[[str], str]
) -> list[common_pb2.KvCacheEvent]:
    """The protocol's events of the log's."""
    out = []
    for e in events:
        if e.block is None:
            assert e.removed is not None
            removed = common_pb2.KvBlocksRemoved(
                block_hashes=[e.removed], tier=DEVICE, locality=LOCAL
            )
            out.append(common_pb2.KvCacheEvent(event_id=e.seq, removed=removed))
            continue
        block = common_pb2.KvBlock(
            block_hash=e.block.value, token_ids=e.block.token_ids, block_size=block_size
        )
        stored = common_pb2.KvBlocksStored(blocks=[block], tier=DEVICE, locality=LOCAL)
        if not e.root and e.block.parent is not None:
            stored.parent_block_hash = e.block.parent
        if e.salt:
            stored.cache_salt = wire_salt(e.salt)
        out.append(common_pb2.KvCacheEvent(event_id=e.seq, stored=stored))
    return out


def engine_load(s: BackendStats, block_size: int, sample: int) -> common_pb2.EngineLoad:
    """The load record of the engine's stats snapshot."""
    e = s.engine
    return common_pb2.EngineLoad(
        running_requests=e.num_running,
        waiting_requests=e.num_waiting,
        token_usage=e.kv_cache_usage,
        gen_throughput=s.generation_tokens_per_second,
        max_running_requests=e.max_num_seqs,
        sample=sample,
        cache_hit_rate=e.prefix_cache_hit_rate,
        num_used_tokens=e.num_kv_blocks_used * block_size,
        max_total_num_tokens=e.num_kv_blocks_total * block_size,
    )


def _load_key(load: common_pb2.EngineLoad) -> tuple[int, int, float]:
    return load.running_requests, load.waiting_requests, round(load.token_usage, 4)


async def kv_event_stream(
    engine: StandardEngine,
    request: common_pb2.SubscribeKvEventsRequest,
    context: Context,
    protocol: str,
    wire_salt: Callable[[str], str],
) -> AsyncIterator[common_pb2.KvEventBatch]:
    """The batches of one subscription, until the subscriber leaves."""
    log_of = getattr(engine.backend, "kv_events", None)
    log: KvEventLog | None = log_of() if callable(log_of) else None
    if log is None:
        await unimplemented(context, protocol, "SubscribeKvEvents", "prefix caching is off")
        return
    block_size = engine.backend.model_info().kv_block_size
    first = log.subscribe()
    try:
        cursor = request.start_sequence_number or first
        sent_seq, sample, last_key = 0, 0, None
        loop = asyncio.get_running_loop()
        last_sent = loop.time()
        loads = request.load_records_before_first_batch  # load_only batches allowed
        while True:
            events, complete, cursor = log.since(cursor, MAX_EVENTS_PER_BATCH)
            sample += 1
            load = engine_load(engine.backend.stats(), block_size, sample)
            batch = None
            if events or not complete:
                pieces = cache_events(events, block_size, wire_salt)
                if not complete:
                    pieces.insert(0, common_pb2.KvCacheEvent(cleared=common_pb2.KvCacheCleared()))
                sent_seq = cursor - 1
                batch = common_pb2.KvEventBatch(
                    sequence_number=sent_seq, events=pieces, dp_rank=0, load=load
                )
                loads = True
            elif loads and (_load_key(load) != last_key or loop.time() - last_sent >= HEARTBEAT_S):
                load.load_only = True
                batch = common_pb2.KvEventBatch(sequence_number=sent_seq, dp_rank=0, load=load)
            if batch is not None:
                last_key, last_sent = _load_key(load), loop.time()
                yield batch
            if len(events) < MAX_EVENTS_PER_BATCH:
                await asyncio.sleep(POLL_S)
    finally:
        log.unsubscribe()
