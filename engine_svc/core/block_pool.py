"""The pool of fixed-size KV blocks: free queue and reference counts.

The free queue is ordered (an OrderedDict used as an O(1) doubly linked list):
blocks are taken from the front and returned to the back, so the block freed
longest ago is reused first. That is LRU order, which the prefix cache
(issue 4) relies on: a freed block keeps its ``block_hash`` until it is
reused, and a cache hit can pull it out of the middle of the queue.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """One block of ``block_size`` token slots in every layer's K/V cache.

    Attributes:
        block_id: index into the cache tensors' block dimension.
        ref_cnt: requests holding this block; 0 means it sits in the free queue.
        block_hash: hash-chain key of a full block (prefix caching), else None.
    """

    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None


class BlockPool:
    """Owns every ``KVCacheBlock``; hands them out and takes them back.

    Invariants: a block is in the free queue iff its ``ref_cnt`` is 0; the
    number of free plus held blocks is always ``num_blocks``.

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

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ``ref_cnt == 0``."""
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

        The caller checks ``num_free_blocks`` first; asking for more is a bug.
        """
        assert num_blocks <= len(self._free), "allocate more blocks than are free"
        out = []
        for _ in range(num_blocks):
            _, block = self._free.popitem(last=False)
            assert block.ref_cnt == 0
            block.ref_cnt = 1
            block.block_hash = None
            out.append(block)
        return out

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
