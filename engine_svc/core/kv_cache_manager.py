"""KV cache policy: which blocks each request holds, and whether more fit."""

from __future__ import annotations

from engine_svc.core.block_pool import BlockPool, KVCacheBlock
from engine_svc.core.request import Request


def cdiv(a: int, b: int) -> int:
    """Ceiling division."""
    return -(a // -b)


class KVCacheManager:
    """Maps requests to block tables on top of a ``BlockPool``.

    A request's table always covers ``num_computed_tokens`` plus the tokens
    scheduled this step::

        block_table: [ b7 | b2 | b9 ]           block_size = 4
        tokens:      0123 4567 89..             10 computed + 1 new -> slot 9*4+2

    Args:
        num_blocks: blocks in the pool.
        block_size: tokens per block.
        enable_prefix_caching: reserved for the prefix cache (issue 4); the
            lookup hook ``get_computed_blocks`` returns no hit until then.
    """

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False
    ) -> None:
        self.block_pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_prefix_queries = 0
        self.num_prefix_hits = 0

    @property
    def num_free_blocks(self) -> int:
        """Free blocks in the pool."""
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks in use."""
        return self.block_pool.usage

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Blocks already holding a prefix of ``request`` and how many tokens they cover.

        The prefix cache plugs in here; without it there is never a hit.
        """
        if self.enable_prefix_caching:
            self.num_prefix_queries += request.num_tokens
        return [], 0

    def num_blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        """Blocks to add so the table covers computed + ``num_new_tokens`` tokens."""
        held = len(self.req_to_blocks.get(request.request_id, ()))
        total = request.num_computed_tokens + num_new_tokens
        return max(0, cdiv(total, self.block_size) - held)

    def can_allocate(self, num_blocks: int, reserve: int = 0) -> bool:
        """Whether ``num_blocks`` fit while keeping ``reserve`` blocks free."""
        return num_blocks + reserve <= self.block_pool.num_free_blocks

    def allocate_slots(
        self, request: Request, num_new_tokens: int, num_lookahead_tokens: int = 0
    ) -> list[KVCacheBlock] | None:
        """Grow ``request``'s table for ``num_new_tokens`` (+ lookahead) tokens.

        Returns:
            The newly added blocks (possibly none), or None when the pool has
            no room; nothing is allocated then.
        """
        needed = self.num_blocks_needed(request, num_new_tokens + num_lookahead_tokens)
        if needed > self.block_pool.num_free_blocks:
            return None
        new_blocks = self.block_pool.get_new_blocks(needed)
        self.req_to_blocks.setdefault(request.request_id, []).extend(new_blocks)
        return new_blocks

    def free(self, request: Request) -> None:
        """Return all of ``request``'s blocks.

        Tail blocks are freed first so they are reused first: under prefix
        caching the head blocks (shared system prompts) stay cached longest.
        """
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        """The block table of a request (empty if it holds none)."""
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]
