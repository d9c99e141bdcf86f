"""KV cache policy: which blocks each request holds, prefix hits, and whether more fit."""

from __future__ import annotations

from collections.abc import Sequence

from engine_svc.core.block_pool import (
    BlockHash,
    BlockPool,
    KVCacheBlock,
    hash_block_tokens,
    salt_root,
)
from engine_svc.core.kv_events import KvEventLog
from engine_svc.core.request import Request


def cdiv(a: int, b: int) -> int:
    """Ceiling division."""
    return -(a // -b)


class KVCacheManager:
    """Maps requests to block tables on top of a ``BlockPool``.

    A request's table always covers ``num_computed_tokens`` plus the tokens
    scheduled this step (and any speculative lookahead)::

        block_table: [ b7 | b2 | b9 ]           block_size = 4
        tokens:      0123 4567 89..             10 computed + 1 new -> slot 9*4+2
                     '--- full, cached ---'

    With prefix caching, every block whose slots are all computed is registered
    under the hash chain of the tokens up to its end; a new request whose
    prompt starts with the same full blocks takes them (ref_cnt + 1) instead of
    computing them. At least one prompt token is always left to compute so the
    step has logits to sample from.

    Args:
        num_blocks: blocks in the pool.
        block_size: tokens per block.
        enable_prefix_caching: share full blocks between requests.
    """

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False
    ) -> None:
        self.block_pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self._num_cached_blocks: dict[str, int] = {}
        self.num_prefix_queries = 0
        self.num_prefix_hits = 0
        # what the prefix cache stores and evicts, for event subscribers (None: no cache)
        self.kv_events = KvEventLog() if enable_prefix_caching else None
        if self.kv_events is not None:
            self.block_pool.on_evict = self.kv_events.removed

    @property
    def num_free_blocks(self) -> int:
        """Free blocks in the pool."""
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks in use."""
        return self.block_pool.usage

    def block_hashes(self, request: Request) -> list[BlockHash]:
        """Hash chain of ``request``'s full blocks, extended lazily and kept on the request.

        A salted request's chain starts under its salt (``salt_root``): it finds only
        blocks computed under the same salt."""
        hashes = request.block_hashes
        bs = self.block_size
        tokens = request.all_token_ids
        root = salt_root(request.cache_salt) if not hashes else None
        while len(hashes) < len(tokens) // bs:
            i = len(hashes)
            parent = hashes[-1] if hashes else root
            hashes.append(hash_block_tokens(parent, tokens[i * bs : (i + 1) * bs]))
        return hashes

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Cached blocks holding the longest full-block prefix of ``request``, and their tokens.

        Stops at the first miss; never covers the last token. Takes no reference.
        """
        if not self.enable_prefix_caching:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in self.block_hashes(request)[:max_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's prompt lookup (tokens asked, tokens found)."""
        if self.enable_prefix_caching:
            self.num_prefix_queries += num_tokens
            self.num_prefix_hits += num_hit_tokens

    def num_blocks_needed(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
    ) -> int:
        """Free blocks consumed to cover computed + ``num_new_tokens`` tokens.

        Cache hits sitting in the free queue count too: touching them takes
        them out of it.
        """
        held = len(self.req_to_blocks.get(request.request_id, ())) + len(new_computed_blocks)
        total = request.num_computed_tokens + num_new_tokens
        evictable = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        return max(0, cdiv(total, self.block_size) - held) + evictable

    def can_allocate(self, num_blocks: int, reserve: int = 0) -> bool:
        """Whether ``num_blocks`` fit while keeping ``reserve`` blocks free."""
        return num_blocks + reserve <= self.block_pool.num_free_blocks

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_lookahead_tokens: int = 0,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
    ) -> list[KVCacheBlock] | None:
        """Grow ``request``'s table for ``num_new_tokens`` (+ lookahead) tokens.

        Args:
            request: its ``num_computed_tokens`` already counts the cache hits.
            num_new_tokens: tokens to compute this step.
            num_lookahead_tokens: speculative slots beyond them.
            new_computed_blocks: prefix-cache hits to put at the table's head.

        Returns:
            The newly allocated blocks (possibly none), or None when the pool
            has no room; nothing is allocated or touched then.
        """
        n = num_new_tokens + num_lookahead_tokens
        needed = self.num_blocks_needed(request, n, new_computed_blocks)
        if needed > self.block_pool.num_free_blocks:
            return None
        table = self.req_to_blocks.setdefault(request.request_id, [])
        self.block_pool.touch(new_computed_blocks)
        table.extend(new_computed_blocks)
        if new_computed_blocks:
            self._num_cached_blocks[request.request_id] = len(table)
        total = cdiv(request.num_computed_tokens + n, self.block_size)
        new_blocks = self.block_pool.get_new_blocks(max(0, total - len(table)))
        table.extend(new_blocks)
        return new_blocks

    def cache_blocks(self, request: Request) -> None:
        """Register the request's blocks that became full of computed tokens."""
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        table = self.req_to_blocks.get(rid, [])
        num_full = min(request.num_computed_tokens // self.block_size, len(table))
        start = self._num_cached_blocks.get(rid, 0)
        if num_full <= start:
            return
        hashes = self.block_hashes(request)
        events = self.kv_events
        for i in range(start, num_full):
            self.block_pool.cache_full_block(table[i], hashes[i])
            if events is not None and table[i].block_hash is hashes[i]:  # newly cached
                events.stored(hashes[i], i == 0, request.cache_salt)
        self._num_cached_blocks[rid] = num_full

    def trim(self, request: Request, num_tokens: int) -> None:
        """Free tail blocks beyond the first ``num_tokens`` slots (rejected speculation)."""
        table = self.req_to_blocks.get(request.request_id)
        keep = cdiv(num_tokens, self.block_size)
        if table is None or len(table) <= keep:
            return
        tail = table[keep:]
        del table[keep:]
        self.block_pool.free_blocks(reversed(tail))

    def free(self, request: Request) -> None:
        """Return all of ``request``'s blocks.

        Tail blocks are freed first so they are reused first: the head blocks
        (shared system prompts) stay cached longest.
        """
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self._num_cached_blocks.pop(request.request_id, None)
        self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        """The block table of a request (empty if it holds none)."""
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]
