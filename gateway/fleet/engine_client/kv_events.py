"""KV events as a routing signal: which prompt prefixes each engine holds in its cache.

An engine that offers smg-grpc-proto's ``SubscribeKvEvents`` streams each full KV block
its prefix cache stores (with the block's tokens, its parent's hash and the cache salt
its chain started under) and each one it evicts. ``follow`` keeps that subscription
open for one replica (resubscribing from the last sequence number after a disconnect)
and applies each batch to the replica's ``PrefixIndex``; the batches' load records go
to the client (TrtllmService has no other load report).

The index never uses the engine's hash function: it keys each block by its own hash of
(parent's key, tokens), a chain's first block by (cache salt, tokens), and keeps the
engine's hash only to apply removals. A request's prompt (``PromptBlocks``) is keyed
the same way, per block size and salt, once per request and only as deep as a lookup
goes, so ``PrefixIndex.match`` says how many of its leading tokens the engine holds.

Bounded: at most ``MAX_BLOCKS`` blocks per replica, the oldest stored dropped first
(the index is a hint: a block it forgot or still lists after a missed removal costs a
routing choice, never a wrong answer). A ``KvCacheCleared`` or a gap the engine reports
empties it.

Routing (``prefix_discount``): a replica's load score is multiplied by
``1 - prefix_weight * cached / prompt``, so among replicas of similar load the one
holding more of the prompt wins, and load still wins when it differs by more.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import grpc
from smg_grpc_proto.generated import common_pb2 as smg_common_pb2  # type: ignore[import-untyped]

from common.log import get_logger
from gateway.config import PREFIX_WEIGHT

log = get_logger(__name__)

MAX_BLOCKS = 32_768  # per replica: 2 dicts of ints, ~5 MiB at the cap
NOT_OFFERED = (
    grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.NOT_FOUND,
)
RETRY_NOT_OFFERED_S = 60.0  # an engine without events is asked again this rarely
_REMOTE = smg_common_pb2.KV_CACHE_LOCALITY_REMOTE


def block_key(parent: int | None, salt: str, token_ids: Sequence[int]) -> int:
    """The index's key of one full block (a chain's first under its salt)."""
    if parent is None:
        return hash((salt, tuple(token_ids)))
    return hash((parent, tuple(token_ids)))


class PromptBlocks:
    """A request's prompt as the prefix indexes look it up.

    Args:
        token_ids: The prompt.
        cache_salt: The request's llm.v1 cache salt (each client says how its protocol
            carries it).
    """

    __slots__ = ("_chains", "cache_salt", "token_ids")

    def __init__(self, token_ids: Sequence[int], cache_salt: str = "") -> None:
        self.token_ids = token_ids
        self.cache_salt = cache_salt
        self._chains: dict[tuple[int, str], list[int]] = {}

    def key(self, block_size: int, salt: str, i: int) -> int | None:
        """The key of full block ``i`` (None past the last full block)."""
        chain = self._chains.setdefault((block_size, salt), [])
        while len(chain) <= i:
            j = len(chain)
            end = (j + 1) * block_size
            if end > len(self.token_ids):
                return None
            parent = chain[-1] if chain else None
            chain.append(block_key(parent, salt, self.token_ids[j * block_size : end]))
        return chain[i]


def prefix_discount(cached_tokens: int, prompt_tokens: int, weight: float = PREFIX_WEIGHT) -> float:
    """The factor on a replica's load score for holding ``cached_tokens`` of the prompt
    (``weight``: the gateway's ``prefix_weight``)."""
    if prompt_tokens <= 0 or cached_tokens <= 0:
        return 1.0
    return 1.0 - weight * min(1.0, cached_tokens / prompt_tokens)


class PrefixIndex:
    """The prompt prefixes one engine holds, as its KV events said (bounded).

    Attributes:
        block_size: The engine's block size (0 until an event says it).
        cursor: The sequence number to resume from (0 = from the engine's current state).
    """

    def __init__(self, max_blocks: int = MAX_BLOCKS) -> None:
        self.max_blocks = max_blocks
        self.block_size = 0
        self.cursor = 0
        self._by_hash: OrderedDict[int, int] = OrderedDict()  # engine hash -> key, oldest first
        self._keys: dict[int, int] = {}  # key -> copies held

    def __len__(self) -> int:
        return len(self._by_hash)

    def clear(self) -> None:
        self._by_hash.clear()
        self._keys.clear()

    def apply(self, batch: Any) -> None:
        """One ``KvEventBatch``'s events, in order."""
        for event in batch.events:
            kind = event.WhichOneof("data")
            if kind == "stored":
                self._stored(event.stored)
            elif kind == "removed":
                for h in event.removed.block_hashes:
                    self._drop(h)
            elif kind == "cleared":
                self.clear()
        if batch.sequence_number:
            self.cursor = batch.sequence_number + 1

    def _stored(self, stored: Any) -> None:
        if stored.HasField("locality") and stored.locality == _REMOTE:
            return  # a shared pool's blocks, not this engine's
        parent_hash = stored.parent_block_hash if stored.HasField("parent_block_hash") else None
        parent = None if parent_hash is None else self._by_hash.get(parent_hash)
        if parent_hash is not None and parent is None:
            return  # its chain is unknown here (stored before the subscription, or dropped)
        salt = stored.cache_salt if stored.HasField("cache_salt") else ""
        for block in stored.blocks:
            if block.HasField("lora_id") or stored.HasField("lora_name"):
                return  # an adapter's blocks: the gateway sends no request under one
            size = block.block_size or len(block.token_ids)
            if not self.block_size:
                self.block_size = size
            if size != self.block_size or len(block.token_ids) != size:
                return  # not a full block of the size prompts are keyed by
            key = block_key(parent, salt, block.token_ids)
            self._add(block.block_hash, key)
            parent = key

    def _add(self, engine_hash: int, key: int) -> None:
        if engine_hash in self._by_hash:
            self._drop(engine_hash)
        self._by_hash[engine_hash] = key
        self._keys[key] = self._keys.get(key, 0) + 1
        while len(self._by_hash) > self.max_blocks:
            self._drop(next(iter(self._by_hash)))

    def _drop(self, engine_hash: int) -> None:
        key = self._by_hash.pop(engine_hash, None)
        if key is None:
            return
        n = self._keys[key] - 1
        if n:
            self._keys[key] = n
        else:
            del self._keys[key]

    def match(self, prompt: PromptBlocks, salt: str) -> int:
        """Leading prompt tokens the engine holds, in whole blocks, under ``salt`` (the
        salt as this engine's events report it)."""
        bs = self.block_size
        if not bs or not self._keys:
            return 0
        n = 0
        while True:
            key = prompt.key(bs, salt, n)
            if key is None or key not in self._keys:
                return n * bs
            n += 1


async def follow(
    subscribe: Callable[[Any], AsyncIterator[Any]],
    index: PrefixIndex,
    on_load: Callable[[Any], None],
    engine: str,
) -> None:
    """Keep one engine's KV event subscription open (forever: cancel it to stop).

    Args:
        subscribe: Opens the stream for a ``SubscribeKvEventsRequest``.
        index: Where the events go.
        on_load: Each batch's ``EngineLoad``.
        engine: How logs name the engine.
    """
    backoff = 0.1
    while True:
        try:
            req = smg_common_pb2.SubscribeKvEventsRequest(
                start_sequence_number=index.cursor, load_records_before_first_batch=True
            )
            async for batch in subscribe(req):
                backoff = 0.1
                if batch.HasField("load"):
                    on_load(batch.load)
                index.apply(batch)
        except grpc.aio.AioRpcError as e:
            if e.code() in NOT_OFFERED:
                log.info("engine offers no KV events", engine=engine, code=e.code().name)
                index.clear()
                await asyncio.sleep(RETRY_NOT_OFFERED_S)
                continue
        await asyncio.sleep(backoff)
        backoff = min(2.0, backoff * 2)
