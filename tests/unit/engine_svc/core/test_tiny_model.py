"""The engine end to end on a tiny random Llama, against HF transformers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlamaForCausalLM as HFLlama

from engine_svc.core import FinishReason, SamplingParams
from engine_svc.models import load_model
from engine_svc.models.attention import build_attention_metadata

from ..conftest import EngineFactory, write_tiny_model
from ..helpers import run_to_completion, tokens_of

PROMPTS = [[5, 17, 33, 2, 9], [40, 41], [3] * 13, [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70]]


def hf_greedy(model: HFLlama, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


@pytest.fixture(scope="module")
def hf_tiny(tiny_model_dir: Path) -> HFLlama:
    return HFLlama.from_pretrained(tiny_model_dir, dtype=torch.float32)


def generate(
    make: EngineFactory, prompts: list[list[int]], n: int = 12, **cfg: Any
) -> list[list[int]]:
    engine = make(**cfg)
    for i, p in enumerate(prompts):
        assert engine.add_request(str(i), p, SamplingParams(max_tokens=n, ignore_eos=True))
    outs = run_to_completion(engine)
    return [tokens_of(outs[str(i)]) for i in range(len(prompts))]


@pytest.mark.parametrize(
    "rope_scaling",
    [
        None,
        {
            "rope_type": "llama3",
            "factor": 4.0,
            "original_max_position_embeddings": 32,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
        },
    ],
)
def test_logits_match_hf_prefill_chunks_and_decode(tmp_path: Path, rope_scaling: Any) -> None:
    path = write_tiny_model(tmp_path, seed=3, rope_scaling=rope_scaling, tie_word_embeddings=True)
    ours = load_model(path, torch.float32)
    ref = HFLlama.from_pretrained(path, dtype=torch.float32)
    cfg = ours.config
    caches = [
        (
            torch.zeros(8, 4, cfg.num_key_value_heads, cfg.head_dim),
            torch.zeros(8, 4, cfg.num_key_value_heads, cfg.head_dim),
        )
        for _ in range(2)
    ]
    ids = torch.randint(0, cfg.vocab_size, (23,), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        expected = ref(ids[None]).logits[0]
        table = [7, 2, 5, 0, 3, 6]
        got = []
        for start, n in [(0, 9), (9, 10), (19, 1), (20, 1), (21, 2)]:
            meta, pos = build_attention_metadata(
                [start], [n], [table], int(n == 1 and start > 0), 4, torch.device("cpu")
            )
            h = ours.forward(ids[start : start + n], pos, meta, caches)
            got.append(ours.compute_logits(h))
    torch.testing.assert_close(torch.cat(got), expected, atol=1e-4, rtol=1e-4)


def test_greedy_matches_hf_alone_batched_chunked(
    make_tiny_engine: EngineFactory, hf_tiny: HFLlama
) -> None:
    expected = [hf_greedy(hf_tiny, p, 12) for p in PROMPTS]
    assert [generate(make_tiny_engine, [p])[0] for p in PROMPTS] == expected
    assert generate(make_tiny_engine, PROMPTS) == expected
    assert generate(make_tiny_engine, PROMPTS, max_num_batched_tokens=3) == expected
    assert generate(make_tiny_engine, PROMPTS, long_prefill_token_threshold=2) == expected


def test_staggered_arrivals_do_not_change_results(make_tiny_engine: EngineFactory) -> None:
    expected = generate(make_tiny_engine, PROMPTS, n=10)
    engine = make_tiny_engine(max_num_batched_tokens=7)
    outs: dict[str, list[int]] = {}
    pending = list(enumerate(PROMPTS))
    while pending or engine.has_unfinished_requests():
        if pending:
            i, p = pending.pop(0)
            engine.add_request(str(i), p, SamplingParams(max_tokens=10, ignore_eos=True))
        for out in engine.step():
            outs.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert [outs[str(i)] for i in range(len(PROMPTS))] == expected


def test_preempt_and_recompute_equals_uninterrupted(make_tiny_engine: EngineFactory) -> None:
    prompts = [p * 2 for p in PROMPTS]
    expected = generate(make_tiny_engine, prompts, n=20)
    engine = make_tiny_engine(num_kv_blocks=16)  # 64 slots for ~4 x 37 tokens
    for i, p in enumerate(prompts):
        engine.add_request(
            str(i), p, SamplingParams(max_tokens=20, ignore_eos=True), priority=1 + i % 3
        )
    outs = run_to_completion(engine)
    assert [tokens_of(outs[str(i)]) for i in range(len(prompts))] == expected
    stats = engine.get_stats()
    assert stats.num_preemptions_total > 0
    assert stats.num_kv_blocks_used == 0
    assert sum(o[-1].num_preemptions for o in outs.values()) == stats.num_preemptions_total


def test_seeded_sampling_is_batch_invariant(make_tiny_engine: EngineFactory) -> None:
    params = SamplingParams(max_tokens=15, temperature=1.0, top_p=0.9, seed=42, ignore_eos=True)
    alone = make_tiny_engine()
    alone.add_request("s", PROMPTS[0], params)
    expected = tokens_of(run_to_completion(alone)["s"])
    mixed = make_tiny_engine(seed=99)
    for i, p in enumerate(PROMPTS[1:]):
        mixed.add_request(str(i), p, SamplingParams(max_tokens=9, temperature=0.8))
    mixed.add_request("s", PROMPTS[0], params)
    assert tokens_of(run_to_completion(mixed)["s"]) == expected


def test_resumed_output_continues_the_same_stream(make_tiny_engine: EngineFactory) -> None:
    full = generate(make_tiny_engine, [PROMPTS[0]], n=12)[0]
    engine = make_tiny_engine()
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    engine.add_request("r", PROMPTS[0], params, resumed_output_token_ids=full[:5])
    outs = run_to_completion(engine)["r"]
    assert tokens_of(outs) == full[5:]
    last = outs[-1]
    assert last.finish_reason == FinishReason.LENGTH
    assert (last.num_output_tokens, last.num_resumed_tokens, last.num_prompt_tokens) == (12, 5, 5)


def test_abort_frees_blocks_and_reports(make_tiny_engine: EngineFactory) -> None:
    engine = make_tiny_engine()
    long_job = SamplingParams(max_tokens=50, ignore_eos=True)
    engine.add_request("a", PROMPTS[2], long_job, tenant_id="team-a")
    engine.add_request("b", PROMPTS[1], SamplingParams(max_tokens=3, ignore_eos=True))
    engine.step()
    assert engine.get_stats().num_kv_blocks_used > 0
    assert engine.get_stats().num_fair_share_tenants == 2  # "team-a" and the anonymous one
    assert engine.abort_request("a")
    assert not engine.abort_request("a")
    assert not engine.abort_request("nope")
    outs = run_to_completion(engine)
    assert outs["a"][-1].finish_reason == FinishReason.ABORT
    assert outs["b"][-1].finish_reason == FinishReason.LENGTH
    assert engine.get_stats().num_kv_blocks_used == 0
    assert engine.get_stats().num_fair_share_tenants == 0


def test_logprobs_and_stop_sequences(make_tiny_engine: EngineFactory) -> None:
    base = generate(make_tiny_engine, [PROMPTS[3]], n=8)[0]
    engine = make_tiny_engine()
    params = SamplingParams(max_tokens=8, logprobs=2, stop_sequences=[base[3:5]], ignore_eos=True)
    engine.add_request("x", PROMPTS[3], params)
    outs = run_to_completion(engine)["x"]
    assert tokens_of(outs) == base[:3]
    lps = [lp for o in outs for lp in (o.new_logprobs or [])]
    assert [lp.token_id for lp in lps] == base[:3]
    assert all(lp.rank == 1 and len(lp.top_token_ids) == 2 for lp in lps)
    assert outs[-1].finish_reason == FinishReason.STOP


def test_queue_full_and_model_info(make_tiny_engine: EngineFactory) -> None:
    engine = make_tiny_engine(max_num_seqs=1, max_waiting=1)
    assert engine.add_request("a", [3], SamplingParams(max_tokens=2))
    assert engine.add_request("b", [3], SamplingParams(max_tokens=2))  # the free slot
    assert not engine.add_request("c", [3], SamplingParams(max_tokens=2))
    info = engine.model_info()
    assert (info.vocab_size, info.eos_token_ids, info.kv_block_size) == (96, [1], 4)
    assert info.max_context_length == 256
    run_to_completion(engine)


@pytest.mark.parametrize(
    ("prompt", "kwargs", "message"),
    [
        ([], {}, "must not be empty"),
        ([3, 96], {}, "outside the vocabulary"),
        ([3] * 256, {}, "leaving no room"),
        ([3] * 250, {"max_tokens": 10}, "lower max_tokens to 6"),
        ([3], {"temperature": -1.0}, "temperature"),
        ([3], {"top_p": 0.0}, "top_p"),
        ([3], {"max_tokens": 0}, "max_tokens"),
        ([3], {"stop_token_ids": [500]}, "stop_token_ids"),
        ([3], {"max_tokens": 200, "kv_blocks": 8}, "KV blocks"),
    ],
)
def test_bad_requests_raise_value_error(
    make_tiny_engine: EngineFactory, prompt: list[int], kwargs: dict[str, Any], message: str
) -> None:
    blocks = kwargs.pop("kv_blocks", 128)
    engine = make_tiny_engine(num_kv_blocks=blocks)
    with pytest.raises(ValueError, match=message):
        engine.add_request("r", prompt, SamplingParams(**kwargs))
    engine.add_request("dup", [3])
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("dup", [3])
    engine.abort_request("dup")


def test_model_failure_fails_the_batch_not_the_engine(
    make_tiny_engine: EngineFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make_tiny_engine()
    engine.add_request("a", [3, 4], SamplingParams(max_tokens=4))

    def boom(*_: object) -> None:
        raise RuntimeError("device fell over")

    monkeypatch.setattr(engine.runner, "execute_model", boom)
    outs = engine.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [("a", FinishReason.ERROR)]
    assert engine.get_stats().num_kv_blocks_used == 0
    monkeypatch.undo()
    engine.add_request("b", [3, 4], SamplingParams(max_tokens=2))
    assert run_to_completion(engine)["b"][-1].finish_reason == FinishReason.LENGTH
