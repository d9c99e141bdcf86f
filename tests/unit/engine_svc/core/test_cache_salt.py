"""Prefix-cache isolation by salt: blocks are reused only under the salt they were
computed with, so a caller's cached-token count says nothing about other salts."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engine_svc.core import SamplingParams
from engine_svc.core.block_pool import salt_root
from engine_svc.core.kv_cache_manager import KVCacheManager
from engine_svc.core.request import Request


def _req(rid: str, tokens: list[int], salt: str = "") -> Request:
    return Request.create(rid, tokens, SamplingParams(max_tokens=4), 0.0, cache_salt=salt)


def _prefill(kv: KVCacheManager, req: Request) -> None:
    hits, num_cached = kv.get_computed_blocks(req)
    req.num_computed_tokens = num_cached
    assert kv.allocate_slots(req, req.num_tokens - num_cached, new_computed_blocks=hits) is not None
    req.num_computed_tokens = req.num_tokens
    kv.cache_blocks(req)


def test_another_salt_finds_nothing_and_the_same_salt_finds_its_blocks() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    prompt = list(range(13))
    _prefill(kv, _req("a1", prompt, "tenant:a"))
    assert kv.get_computed_blocks(_req("b1", prompt, "tenant:b"))[1] == 0
    assert kv.get_computed_blocks(_req("u1", prompt))[1] == 0  # nor the unsalted pool
    assert kv.get_computed_blocks(_req("a2", prompt, "tenant:a"))[1] == 12


def test_unsalted_requests_share_as_before() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    prompt = list(range(9))
    _prefill(kv, _req("u1", prompt))
    assert kv.get_computed_blocks(_req("u2", prompt))[1] == 8
    assert kv.get_computed_blocks(_req("s1", prompt, "tenant:a"))[1] == 0
    assert salt_root("") is None


@settings(max_examples=60, deadline=None)
@given(
    salts=st.lists(st.text(min_size=0, max_size=12), min_size=2, max_size=4, unique=True),
    prompt=st.lists(st.integers(0, 50), min_size=5, max_size=24),
)
def test_blocks_are_reused_only_under_their_own_salt(salts: list[str], prompt: list[int]) -> None:
    kv = KVCacheManager(num_blocks=64, block_size=4, enable_prefix_caching=True)
    owner, *others = salts
    _prefill(kv, _req("owner", prompt, owner))
    full_blocks = (len(prompt) - 1) // 4 * 4
    assert kv.get_computed_blocks(_req("again", prompt, owner))[1] == full_blocks
    for i, salt in enumerate(others):
        assert kv.get_computed_blocks(_req(f"other{i}", prompt, salt))[1] == 0
