"""The pool of fixed-size KV blocks: free queue, reference counts, prefix-cache map.

The free queue is ordered (an OrderedDict used as an O(1) doubly linked list):
blocks are taken from the front and returned to the back, so the block freed
longest ago is reused first. That is LRU order for the prefix cache: a freed
block keeps its ``block_hash`` (and stays findable) until it is reused, and a
cache hit pulls it out of the middle of the queue. Eviction therefore happens
only when a new block is needed and the oldest free block is a cached one.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class BlockHash:
    """Key of one full block: a hash chained over every block before it.

    ``value`` is ``hash((parent_value, token_ids))``; the parent and the tokens
    are kept so that a hit is checked token by token (a hash collision is a
    miss, never wrong KV).
    """

    value: int
    parent: int | None
    token_ids: tuple[int, ...]


def hash_block_tokens(parent: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """The chained hash of a full block whose predecessor hashes to ``parent``."""
    parent_value = None if parent is None else parent.value
    tokens = tuple(token_ids)
    return BlockHash(hash((parent_value, tokens)), parent_value, tokens)


def salt_root(cache_salt: str) -> BlockHash | None:
    """The parent of a salted request's first block: chains under different salts
    never meet, so a block is reused only under the salt it was computed with
    (None for the unsalted pool). Two salts collide only if their 64-bit hashes do."""
    if not cache_salt:
        return None
    return BlockHash(hash(("cache_salt", cache_salt)), None, ())


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """One block of ``block_size`` token slots in every layer's K/V cache.

    Attributes:
        block_id: index into the cache tensors' block dimension.
        ref_cnt: requests holding this block; 0 means it sits in the free queue.
        block_hash: key of a full, cached block (prefix caching), else None.
    """

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None


class BlockPool:
    """Owns every ``KVCacheBlock``; hands them out, takes them back, indexes cached ones.

    Invariants: a block is in the free queue iff its ``ref_cnt`` is 0; free plus
    held blocks is always ``num_blocks``; ``cached_blocks[h.value]`` is the only
    block whose ``block_hash`` is ``h``.

    Args:
        num_blocks: blocks in the pool (the cache tensors' first dimension).
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, KVCacheBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks
        )
        self.cached_blocks: dict[int, KVCacheBlock] = {}
        self.num_evictions = 0
        self.on_evict: Callable[[int], None] | None = None  # a cached block's hash, evicted

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ``ref_cnt == 0`` (cached or not: both are reusable)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by at least one request."""
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0..1."""
        return self.num_used_blocks / self.num_blocks

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` blocks from the front of the free queue (ref_cnt 1).

        A cached block taken here is evicted from the prefix cache. The caller
        checks ``num_free_blocks`` first; asking for more is a bug.
        """
        assert num_blocks <= len(self._free), "allocate more blocks than are free"
        out = []
        for _ in range(num_blocks):
            _, block = self._free.popitem(last=False)
            assert block.ref_cnt == 0
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        if self.cached_blocks.get(block.block_hash.value) is block:
            del self.cached_blocks[block.block_hash.value]
            self.num_evictions += 1
            if self.on_evict is not None:
                self.on_evict(block.block_hash.value)
        block.block_hash = None

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """The cached block for ``block_hash``, or None (also on a hash collision)."""
        block = self.cached_blocks.get(block_hash.value)
        if block is None or block.block_hash != block_hash:
            return None
        return block

    def cache_full_block(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        """Register a block whose slots are all computed under ``block_hash``.

        If another block already holds the same key (two requests computed the
        same prefix at once) the first one stays the cached copy.
        """
        if block.block_hash is not None or block_hash.value in self.cached_blocks:
            return
        block.block_hash = block_hash
        self.cached_blocks[block_hash.value] = block

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Add a reference to each block, pulling free ones out of the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference per block; blocks reaching 0 join the queue's back in order."""
        for block in blocks:
            assert block.ref_cnt > 0, f"block {block.block_id} freed twice"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def free_block_ids(self) -> list[int]:
        """Ids in the free queue, front (next to be reused) first."""
        return list(self._free)
