"""Speculative decoding by prompt lookup: same tokens as plain decoding, fewer passes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from engine_svc.core import LLMEngine, SamplingParams
from engine_svc.core.ngram_proposer import NgramProposer

from ..conftest import EngineFactory
from ..helpers import run_to_completion, tokens_of

LOOPY = [5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8, 9, 10, 11, 5, 6, 7]


def test_proposer_takes_the_latest_longest_match() -> None:
    p = NgramProposer(num_speculative_tokens=3, min_n=1, max_n=3)
    assert p.propose([1, 2, 3, 4, 5, 9, 2, 3]) == [4, 5, 9]
    assert p.propose([1, 2, 3, 4, 1, 2, 3]) == [4, 1, 2]
    assert p.propose([1, 2, 8, 1, 2, 9, 1, 2]) == [9, 1, 2]  # most recent match wins
    assert p.propose([1, 2, 3, 4, 1, 2, 3], max_tokens=1) == [4]
    assert p.propose([5, 6, 7]) == []
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        NgramProposer(num_speculative_tokens=0)


class OracleProposer(NgramProposer):
    """Drafts the known plain-decoding continuation, with every ``bad``-th draft wrong."""

    def __init__(self, refs: list[list[int]], k: int, bad: int | None) -> None:
        super().__init__(num_speculative_tokens=k)
        self.refs = refs
        self.bad = bad

    def propose(self, token_ids: Sequence[int], max_tokens: int | None = None) -> list[int]:
        n = len(token_ids)
        ref = next(r for r in self.refs if r[:n] == list(token_ids))
        drafts = ref[n : n + min(self.k, max_tokens or self.k)]
        if self.bad is not None and len(drafts) > self.bad:
            drafts[self.bad] = (drafts[self.bad] + 1) % 96
        return drafts


PROMPTS = [LOOPY, [40, 41, 42, 40, 41], [*LOOPY[3:], 1, 2]]


def _run(engine: LLMEngine, params: list[SamplingParams], spec: bool) -> list[Any]:
    for i, (p, sp) in enumerate(zip(PROMPTS, params, strict=False)):
        assert engine.add_request(str(i), p, sp, speculative=spec)
    outs = run_to_completion(engine)
    assert engine.kv_cache_manager.block_pool.num_used_blocks == 0  # rejected KV rolled back
    return [(tokens_of(outs[str(i)]), outs[str(i)][-1]) for i in range(len(params))]


PARAMS = [
    [SamplingParams(max_tokens=24, ignore_eos=True)] * 3,
    [
        SamplingParams(max_tokens=20, temperature=0.8, seed=11, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=1.0, top_k=5, seed=3, min_tokens=6),
        SamplingParams(max_tokens=20, repetition_penalty=1.3, logprobs=2, ignore_eos=True),
    ],
]


@pytest.mark.parametrize("params", PARAMS, ids=["greedy", "seeded-penalties-logprobs"])
@pytest.mark.parametrize("bad", [None, 1])
def test_spec_output_identical_to_plain(
    make_tiny_engine: EngineFactory, params: list[SamplingParams], bad: int | None
) -> None:
    plain = _run(make_tiny_engine(), params, spec=False)
    engine = make_tiny_engine(num_speculative_tokens=3)
    refs = [p + t for p, (t, _) in zip(PROMPTS, plain, strict=False)]
    engine.scheduler.proposer = OracleProposer(refs, 3, bad)
    spec = _run(engine, params, spec=True)
    for (p_tok, p_out), (s_tok, s_out) in zip(plain, spec, strict=True):
        assert s_tok == p_tok
        assert s_out.finish_reason == p_out.finish_reason
        assert p_out.num_draft_tokens == 0
        assert s_out.num_draft_tokens > 0
        if bad is None:  # right drafts are always accepted
            assert s_out.num_accepted_tokens == s_out.num_draft_tokens
        else:  # the 2nd draft is wrong: one accepted per pass (the last pass may hold fewer)
            assert s_out.num_accepted_tokens == -(-s_out.num_draft_tokens // 3)
    stats = engine.get_stats()
    assert stats.num_draft_tokens_total == sum(o.num_draft_tokens for _, o in spec)
    assert stats.num_accepted_tokens_total == sum(o.num_accepted_tokens for _, o in spec)
    longest = max(len(t) for t, _ in spec)
    assert stats.num_steps_total <= 1 + -(-longest // (4 if bad is None else 2)) + 1


def test_logprobs_follow_the_accepted_tokens(make_tiny_engine: EngineFactory) -> None:
    sp = SamplingParams(max_tokens=16, logprobs=1, ignore_eos=True)
    engine = make_tiny_engine(num_speculative_tokens=3)
    ((ref, _),) = _run(make_tiny_engine(), [sp], spec=False)
    engine.scheduler.proposer = OracleProposer([LOOPY + ref], 3, 2)
    engine.add_request("x", LOOPY, sp, speculative=True)
    outs = run_to_completion(engine)["x"]
    lps = [lp for o in outs for lp in (o.new_logprobs or [])]
    assert [lp.token_id for lp in lps] == tokens_of(outs) == ref


def test_ngram_drafts_on_a_real_engine_path(make_tiny_engine: EngineFactory) -> None:
    sp = [SamplingParams(max_tokens=40, ignore_eos=True)] * 3
    plain = _run(make_tiny_engine(), sp, spec=False)
    engine = make_tiny_engine(num_speculative_tokens=3, prompt_lookup_min=1)
    spec = _run(engine, sp, spec=True)
    assert [t for t, _ in spec] == [t for t, _ in plain]
    assert engine.get_stats().num_draft_tokens_total > 0


def test_per_request_switch_and_engine_off(make_tiny_engine: EngineFactory) -> None:
    sp = [SamplingParams(max_tokens=12, ignore_eos=True)]
    on = make_tiny_engine(enable_speculative_decoding=True, num_speculative_tokens=3)
    ((_, out),) = _run(on, sp, spec=False)
    assert out.num_draft_tokens == 0
    off = make_tiny_engine(num_speculative_tokens=0)
    ((_, out),) = _run(off, sp, spec=True)
    assert out.num_draft_tokens == 0


def test_spec_with_prefix_cache_and_tight_pool(make_tiny_engine: EngineFactory) -> None:
    params = [SamplingParams(max_tokens=30, ignore_eos=True)] * 3
    plain = _run(make_tiny_engine(num_kv_blocks=14), params, spec=False)
    spec = _run(make_tiny_engine(num_kv_blocks=14, num_speculative_tokens=4), params, spec=True)
    assert [t for t, _ in spec] == [t for t, _ in plain]
