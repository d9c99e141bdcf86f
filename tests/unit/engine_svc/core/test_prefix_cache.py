"""Prefix caching: exact block ids, ref counts, LRU eviction, identical outputs."""

from __future__ import annotations

from engine_svc.core import LLMEngine, SamplingParams
from engine_svc.core.block_pool import BlockHash, BlockPool, hash_block_tokens
from engine_svc.core.kv_cache_manager import KVCacheManager
from engine_svc.core.request import Request

from ..conftest import EngineFactory
from ..helpers import run_to_completion, tokens_of


def _req(rid: str, tokens: list[int]) -> Request:
    return Request.create(rid, tokens, SamplingParams(max_tokens=4), 0.0)


def _prefill(kv: KVCacheManager, req: Request) -> None:
    """Admit like the scheduler does and mark the whole prompt computed."""
    hits, num_cached = kv.get_computed_blocks(req)
    req.num_computed_tokens = num_cached
    assert kv.allocate_slots(req, req.num_tokens - num_cached, new_computed_blocks=hits) is not None
    req.num_computed_tokens = req.num_tokens
    kv.cache_blocks(req)


def test_hash_chain_depends_on_every_earlier_block() -> None:
    a = hash_block_tokens(None, [1, 2, 3, 4])
    b = hash_block_tokens(a, [5, 6, 7, 8])
    c = hash_block_tokens(hash_block_tokens(None, [1, 2, 3, 9]), [5, 6, 7, 8])
    assert b.parent == a.value
    assert b != c  # same tokens, different prefix
    assert hash_block_tokens(None, [1, 2, 3, 4]) == a


def test_full_blocks_are_shared_with_ref_counts() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=4, enable_prefix_caching=True)
    a = _req("a", list(range(10)))
    _prefill(kv, a)
    assert kv.get_block_ids("a") == [0, 1, 2]
    assert sorted(b.block_id for b in kv.block_pool.cached_blocks.values()) == [0, 1]
    b = _req("b", [*list(range(8)), 50, 51, 52])
    hits, num_cached = kv.get_computed_blocks(b)
    assert ([h.block_id for h in hits], num_cached) == ([0, 1], 8)
    b.num_computed_tokens = num_cached  # the scheduler counts hits as computed first
    assert kv.num_blocks_needed(b, 3, hits) == 1
    new = kv.allocate_slots(b, 3, new_computed_blocks=hits)
    assert new is not None
    assert [x.block_id for x in new] == [3]
    assert kv.get_block_ids("b") == [0, 1, 3]
    assert [blk.ref_cnt for blk in kv.block_pool.blocks] == [2, 2, 1, 1, 0, 0]


def test_freed_cached_blocks_stay_findable_and_hits_take_them_back() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=4, enable_prefix_caching=True)
    a, b = _req("a", list(range(10))), _req("b", [*list(range(8)), 50, 51, 52])
    _prefill(kv, a)
    _prefill(kv, b)
    kv.free(a)
    assert kv.block_pool.free_block_ids() == [4, 5, 2]
    kv.free(b)
    assert kv.block_pool.free_block_ids() == [4, 5, 2, 3, 1, 0]  # tail first, shared head last
    c = _req("c", [*list(range(8)), 9])
    hits, num_cached = kv.get_computed_blocks(c)
    assert ([h.block_id for h in hits], num_cached) == ([0, 1], 8)
    c.num_computed_tokens = 8
    assert kv.num_blocks_needed(c, 1, hits) == 3  # 1 new + 2 hits pulled out of the queue
    kv.allocate_slots(c, 1, new_computed_blocks=hits)
    assert kv.get_block_ids("c") == [0, 1, 4]
    assert kv.block_pool.free_block_ids() == [5, 2, 3]


def test_eviction_is_lru_and_only_when_blocks_are_needed() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_prefix_caching=True)
    a = _req("a", list(range(9)))
    _prefill(kv, a)  # blocks 0, 1 cached; block 2 partial
    kv.free(a)
    assert kv.block_pool.free_block_ids() == [3, 2, 1, 0]
    assert len(kv.block_pool.cached_blocks) == 2
    b = _req("b", [70] * 12)
    _prefill(kv, b)  # takes 3, 2, 1: evicts cached block 1, keeps block 0
    assert kv.get_block_ids("b") == [3, 2, 1]
    assert kv.block_pool.num_evictions == 1
    hits, num_cached = kv.get_computed_blocks(_req("c", list(range(9))))
    assert ([h.block_id for h in hits], num_cached) == ([0], 4)


def test_last_token_is_always_computed() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_prefix_caching=True)
    _prefill(kv, _req("a", list(range(8))))
    hits, num_cached = kv.get_computed_blocks(_req("b", list(range(8))))
    assert ([h.block_id for h in hits], num_cached) == ([0], 4)


def test_hash_collision_is_a_miss() -> None:
    pool = BlockPool(2)
    (blk,) = pool.get_new_blocks(1)
    real = hash_block_tokens(None, [1, 2])
    pool.cache_full_block(blk, real)
    forged = BlockHash(real.value, None, (3, 4))
    assert pool.get_cached_block(real) is blk
    assert pool.get_cached_block(forged) is None


def test_disabled_cache_never_hits() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    _prefill(kv, _req("a", list(range(9))))
    assert kv.get_computed_blocks(_req("b", list(range(9)))) == ([], 0)
    assert not kv.block_pool.cached_blocks


def test_engine_outputs_identical_with_and_without_prefix_cache(
    make_tiny_engine: EngineFactory,
) -> None:
    system = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]
    prompts = [[*system, 20 + i, 30 + i] for i in range(4)]
    results = {}
    for enabled in (False, True):
        engine = make_tiny_engine(enable_prefix_caching=enabled)
        first = {"s": run_prompt(engine, "warm", [*system, 5])}
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, SamplingParams(max_tokens=8, ignore_eos=True))
        outs = run_to_completion(engine)
        results[enabled] = (first, [tokens_of(outs[str(i)]) for i in range(4)])
        cached = [outs[str(i)][-1].num_cached_tokens for i in range(4)]
        stats = engine.get_stats()
        if enabled:
            assert cached == [12] * 4  # three full 4-token blocks of the system prompt
            assert stats.prefix_cache_hits == 48
            assert stats.prefix_cache_queries == 13 + 4 * 14
        else:
            assert cached == [0] * 4
            assert stats.prefix_cache_hits == 0
        assert engine.kv_cache_manager.block_pool.num_used_blocks == 0
    assert results[True] == results[False]


def run_prompt(engine: LLMEngine, rid: str, prompt: list[int]) -> list[int]:
    engine.add_request(rid, prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    return tokens_of(run_to_completion(engine)[rid])
