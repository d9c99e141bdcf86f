"""SmolLM2-135M-Instruct on the engine vs HF transformers, both fp32.

Greedy continuations must match token for token, except after a position
where HF's own top-1/top-2 margin is inside numeric noise (there either
choice is right: kernels block differently per batch shape).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM

from engine_svc.core import EngineConfig, LLMEngine, SamplingParams
from engine_svc.models.attention import build_attention_metadata

from ..helpers import run_to_completion, tokens_of

pytestmark = pytest.mark.slow

TEXTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "<|im_start|>user\nList three primary colors.<|im_end|>\n<|im_start|>assistant\n",
]
NEW_TOKENS = 16
NOISE_MARGIN = 1e-3


@pytest.fixture(scope="module")
def hf_model(model_dir: Path) -> torch.nn.Module:
    model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model


@pytest.fixture(scope="module")
def prompts(model_dir: Path) -> list[list[int]]:
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    return [tok.encode(t).ids for t in TEXTS]


@pytest.fixture(scope="module")
def hf_greedy(
    hf_model: torch.nn.Module, prompts: list[list[int]]
) -> list[tuple[list[int], list[float]]]:
    """Per prompt: HF greedy tokens and the top-1/top-2 margin at each step."""
    results = []
    with torch.inference_mode():
        for p in prompts:
            out = hf_model(torch.tensor([p]), use_cache=True)
            tokens, margins = [], []
            for _ in range(NEW_TOKENS):
                logits = out.logits[0, -1]
                top2 = logits.topk(2).values
                tokens.append(int(logits.argmax()))
                margins.append(float(top2[0] - top2[1]))
                out = hf_model(torch.tensor([[tokens[-1]]]), cache=out.cache, use_cache=True)
            results.append((tokens, margins))
    return results


def assert_greedy_equal(ours: list[int], ref: tuple[list[int], list[float]]) -> None:
    tokens, margins = ref
    for i, (a, b) in enumerate(zip(ours, tokens, strict=True)):
        if a != b:
            assert margins[i] < NOISE_MARGIN, f"diverged at {i} with HF margin {margins[i]:.4f}"
            return


def test_logits_match_hf_for_prefill_and_decode(
    real_engine: LLMEngine, hf_model: torch.nn.Module, prompts: list[list[int]]
) -> None:
    model = real_engine.model
    cfg = model.config
    shape = (4, 16, cfg.num_key_value_heads, cfg.head_dim)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(cfg.num_hidden_layers)]
    ids = prompts[2] + [28, 253, 1035]
    n = len(prompts[2])
    cpu = torch.device("cpu")
    with torch.inference_mode():
        expected = hf_model(torch.tensor([ids])).logits[0]
        got = []
        meta, pos = build_attention_metadata([0], [n], [[3, 1]], 0, 16, cpu)
        got.append(model.compute_logits(model.forward(torch.tensor(ids[:n]), pos, meta, caches)))
        for i in range(n, len(ids)):
            meta, pos = build_attention_metadata([i], [1], [[3, 1]], 1, 16, cpu)
            got.append(
                model.compute_logits(model.forward(torch.tensor(ids[i : i + 1]), pos, meta, caches))
            )
    torch.testing.assert_close(torch.cat(got), expected, atol=2e-3, rtol=1e-3)


def _params() -> SamplingParams:
    return SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)


def test_greedy_alone_matches_hf(
    real_engine: LLMEngine, prompts: list[list[int]], hf_greedy: list[tuple[list[int], list[float]]]
) -> None:
    for p, ref in zip(prompts, hf_greedy, strict=True):
        real_engine.add_request("alone", p, _params())
        assert_greedy_equal(tokens_of(run_to_completion(real_engine)["alone"]), ref)


def test_greedy_batched_and_staggered_match_hf(
    real_engine: LLMEngine, prompts: list[list[int]], hf_greedy: list[tuple[list[int], list[float]]]
) -> None:
    for i, p in enumerate(prompts):
        real_engine.add_request(f"b{i}", p, _params())
    outs = run_to_completion(real_engine)
    for i, ref in enumerate(hf_greedy):
        assert_greedy_equal(tokens_of(outs[f"b{i}"]), ref)
    streams: dict[str, list[int]] = {}
    pending = list(enumerate(prompts))
    while pending or real_engine.has_unfinished_requests():
        for _ in range(3):  # a new arrival every third step
            for out in real_engine.step():
                streams.setdefault(out.request_id, []).extend(out.new_token_ids)
        if pending:
            i, p = pending.pop()
            real_engine.add_request(f"s{i}", p, _params())
    for i, ref in enumerate(hf_greedy):
        assert_greedy_equal(streams[f"s{i}"], ref)


def test_chunked_prefill_matches_hf(
    real_engine: LLMEngine,
    prompts: list[list[int]],
    hf_greedy: list[tuple[list[int], list[float]]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(real_engine.scheduler.config, "max_num_batched_tokens", 6)
    for i, p in enumerate(prompts):
        real_engine.add_request(f"c{i}", p, _params())
    outs = run_to_completion(real_engine)
    for i, ref in enumerate(hf_greedy):
        assert_greedy_equal(tokens_of(outs[f"c{i}"]), ref)


# bf16 weights and KV move this model's logits by ~0.13 on average against fp32
# (measured over three prompts' prefill positions); where HF's own top-1/top-2
# margin is below this, either token is a correct greedy choice
DEFAULT_NOISE_MARGIN = 0.5


def test_default_config_greedy_matches_hf_fp32(
    model_dir: Path,
    prompts: list[list[int]],
    hf_greedy: list[tuple[list[int], list[float]]],
) -> None:
    """The stack's default engine (dtype and KV chosen for this CPU) keeps HF fp32's greedy
    output wherever the choice is not a numeric coin toss, alone and batched."""
    engine = LLMEngine(EngineConfig(model_dir=str(model_dir), num_kv_blocks=256))
    for i, p in enumerate(prompts):
        engine.add_request(f"d{i}", p, _params())
    outs = run_to_completion(engine)
    for i, ref in enumerate(hf_greedy):
        tokens, margins = ref
        ours = tokens_of(outs[f"d{i}"])
        for j, (a, b) in enumerate(zip(ours, tokens, strict=True)):
            if a != b:
                assert margins[j] < DEFAULT_NOISE_MARGIN, (
                    f"prompt {i} diverged at {j} with HF margin {margins[j]:.4f} "
                    f"({engine.compute_description})"
                )
                break
