"""Block pool and KV cache manager: exact block ids, ref counts, free order."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engine_svc.core.block_pool import BlockPool
from engine_svc.core.kv_cache_manager import KVCacheManager
from engine_svc.core.request import Request
from engine_svc.core.sampling_params import SamplingParams


def _req(rid: str, n: int) -> Request:
    return Request.create(rid, list(range(n)), SamplingParams(max_tokens=4), 0.0)


def test_pool_hands_out_from_the_front_and_returns_to_the_back() -> None:
    pool = BlockPool(4)
    a = pool.get_new_blocks(2)
    assert [b.block_id for b in a] == [0, 1]
    assert [b.ref_cnt for b in a] == [1, 1]
    assert pool.num_free_blocks == 2
    pool.free_blocks(a)
    assert pool.free_block_ids() == [2, 3, 0, 1]
    assert [b.block_id for b in pool.get_new_blocks(3)] == [2, 3, 0]


def test_touch_and_shared_ref_counts() -> None:
    pool = BlockPool(3)
    (b,) = pool.get_new_blocks(1)
    pool.touch([b])
    assert b.ref_cnt == 2
    pool.free_blocks([b])
    assert b.ref_cnt == 1
    assert pool.num_free_blocks == 2
    pool.free_blocks([b])
    assert pool.free_block_ids() == [1, 2, 0]
    pool.touch([b])  # a cache hit on a free block pulls it out of the queue
    assert pool.free_block_ids() == [1, 2]
    assert pool.usage == 1 / 3


def test_allocate_slots_grows_tables_and_reports_no_room() -> None:
    kv = KVCacheManager(num_blocks=5, block_size=4)
    r1, r2 = _req("a", 9), _req("b", 6)
    assert kv.allocate_slots(r1, 9) is not None
    assert kv.get_block_ids("a") == [0, 1, 2]
    r1.num_computed_tokens = 9
    new = kv.allocate_slots(r1, 3)  # tokens 9..11 fit in block 2
    assert new == []
    assert kv.allocate_slots(r2, 6) is not None
    assert kv.get_block_ids("b") == [3, 4]
    r1.num_computed_tokens = 12
    assert kv.allocate_slots(r1, 1) is None  # needs a 4th block, pool empty
    assert kv.get_block_ids("a") == [0, 1, 2]  # nothing half-allocated
    kv.free(r1)
    assert kv.block_pool.free_block_ids() == [2, 1, 0]  # tail first
    assert kv.get_block_ids("a") == []


def test_lookahead_slots_are_reserved() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    r = _req("a", 4)
    kv.allocate_slots(r, 4, num_lookahead_tokens=5)
    assert kv.get_block_ids("a") == [0, 1, 2]


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["grow", "free"]), st.integers(0, 5), st.integers(1, 20)),
        max_size=60,
    )
)
def test_no_block_owned_twice_and_every_block_returns(ops: list[tuple[str, int, int]]) -> None:
    num_blocks = 16
    kv = KVCacheManager(num_blocks=num_blocks, block_size=4)
    reqs = {i: _req(str(i), 1) for i in range(6)}
    for op, i, n in ops:
        r = reqs[i]
        if op == "grow":
            if kv.allocate_slots(r, n) is not None:
                r.num_computed_tokens += n
        else:
            kv.free(r)
            r.num_computed_tokens = 0
        owned = [b for blocks in kv.req_to_blocks.values() for b in blocks]
        ids = [b.block_id for b in owned]
        assert len(ids) == len(set(ids))
        assert all(b.ref_cnt == 1 for b in owned)
        assert len(ids) + kv.num_free_blocks == num_blocks
        for rid, blocks in kv.req_to_blocks.items():
            assert len(blocks) * 4 >= reqs[int(rid)].num_computed_tokens
    for r in reqs.values():
        kv.free(r)
    assert kv.num_free_blocks == num_blocks
    assert sorted(kv.block_pool.free_block_ids()) == list(range(num_blocks))
