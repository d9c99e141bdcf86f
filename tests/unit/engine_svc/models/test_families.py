"""Every supported model family against transformers' own implementation, in fp32.

Each family is a tiny random-weight checkpoint built here with transformers
(hidden 64, 2 layers, vocab 128; nothing downloaded) and saved as an HF
directory. The engine's model must give transformers' logits at every position
of a prompt fed as two prefill chunks (the second reading the first from the
paged cache) and then token by token as decodes; the windows are shorter than
the prompt, so sliding layers mask by position, and the softcaps are small, so
their tanh bends the scores. Through LLMEngine, greedy tokens must equal
transformers' ``generate``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from engine_svc.core import EngineConfig, LLMEngine, SamplingParams
from engine_svc.models import load_model
from engine_svc.models.attention import build_attention_metadata
from engine_svc.models.config import SUPPORTED_ARCHITECTURES, load_model_config
from engine_svc.models.llama import LlamaForCausalLM
from engine_svc.models.path_choice import Workload, measure

from ..conftest import TINY_CONFIG
from ..helpers import run_to_completion, tokens_of

# the shared tiny Llama's shape (vocab 128 here), as each family's config arguments
SHAPE: dict[str, Any] = {
    k: v
    for k, v in TINY_CONFIG.items()
    if k not in ("architectures", "model_type", "rope_theta", "hidden_act", "tie_word_embeddings")
} | {"vocab_size": 128, "pad_token_id": 2}
WINDOW = 6  # shorter than the prompt: sliding layers see a part of it
GEMMA: dict[str, Any] = {"query_pre_attn_scalar": 24, "sliding_window": WINDOW}


def _configs() -> dict[str, Callable[[], PretrainedConfig]]:
    llama3 = {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16, "rope_theta": 500000.0,
    }  # fmt: skip
    return {
        "llama3_tied": lambda: transformers.LlamaConfig(
            **SHAPE, rope_parameters=llama3, tie_word_embeddings=True
        ),
        "llama_linear_rope": lambda: transformers.LlamaConfig(
            **SHAPE, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}
        ),
        "mistral_window": lambda: transformers.MistralConfig(**SHAPE, sliding_window=WINDOW),
        "qwen2_bias": lambda: transformers.Qwen2Config(**SHAPE),
        "qwen3_qk_norm": lambda: transformers.Qwen3Config(**SHAPE),
        "gemma2": lambda: transformers.Gemma2Config(
            **SHAPE, **GEMMA, attn_logit_softcapping=2.0, final_logit_softcapping=3.0
        ),
        "gemma3": lambda: transformers.Gemma3TextConfig(
            **SHAPE, **GEMMA, layer_types=["sliding_attention", "full_attention"]
        ),
    }


FAMILIES = list(_configs())


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights large enough that logits spread, norms away from their init (1, or 0
    for Gemma's 1 + w), biases nonzero: a missed feature moves the logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name:
                p.add_(noise * 0.2)
            elif name.endswith("bias"):
                p.copy_(noise * 0.3)
            else:
                p.copy_(noise * (1.0 if "embed" in name else 0.25))


@pytest.fixture(scope="module", params=FAMILIES)
def family(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, Path, PreTrainedModel]:
    """(name, checkpoint dir, transformers model in fp32 with eager attention)."""
    name = request.param
    config = _configs()[name]()
    config._attn_implementation = "eager"  # the reference that honors softcapping
    torch.manual_seed(0)
    model: PreTrainedModel = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
        config, dtype=torch.float32
    )
    _randomize(model, FAMILIES.index(name))
    torch.nn.Module.eval(model)
    path = tmp_path_factory.mktemp(name)
    model.save_pretrained(path)
    return name, path, model


PROMPT = [5, 17, 99, 3, 42, 8, 120, 64, 11, 77, 31, 9]  # 12 tokens, twice the window
FIRST_CHUNK = 5
DECODES = [23, 101, 7, 50]


def _paged_logits(model: LlamaForCausalLM, kv_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Logits at every position of PROMPT + DECODES: two prefill chunks, then decodes,
    through a paged cache of ``kv_dtype`` in scattered blocks (FP8 with unit scales)."""
    cfg = model.config
    block_size = 4
    shape = (8, block_size, cfg.num_key_value_heads, cfg.head_dim)
    caches = [
        (torch.zeros(shape, dtype=kv_dtype), torch.zeros(shape, dtype=kv_dtype))
        for _ in range(cfg.num_hidden_layers)
    ]
    scales = None
    if kv_dtype == torch.float8_e4m3fn:
        unit = torch.ones(cfg.num_key_value_heads)
        scales = [(unit, unit)] * cfg.num_hidden_layers
    table = [[6, 2, 7, 1, 3, 5]]
    ids = PROMPT + DECODES
    cpu = torch.device("cpu")

    def run(start: int, count: int, decodes: int) -> torch.Tensor:
        meta, pos = build_attention_metadata([start], [count], table, decodes, block_size, cpu)
        hidden = model.forward(torch.tensor(ids[start : start + count]), pos, meta, caches, scales)
        return model.compute_logits(hidden)

    with torch.inference_mode():
        got = [run(0, FIRST_CHUNK, 0), run(FIRST_CHUNK, len(PROMPT) - FIRST_CHUNK, 0)]
        got += [run(i, 1, 1) for i in range(len(PROMPT), len(ids))]
    return torch.cat(got)


def test_logits_match_transformers_through_paged_kv(
    family: tuple[str, Path, PreTrainedModel],
) -> None:
    _, path, hf = family
    with torch.inference_mode():
        expected = hf(torch.tensor([PROMPT + DECODES])).logits[0]
    got = _paged_logits(load_model(path, torch.float32))
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=1e-4)


def test_bf16_and_fp8_paths_stay_close(family: tuple[str, Path, PreTrainedModel]) -> None:
    """bf16 weights and KV, and FP8 projections with an FP8 KV cache, on the same
    family features: every position's logits point the way fp32's do."""
    _, path, _ = family
    ref = _paged_logits(load_model(path, torch.float32))
    variants = {
        "bf16": (load_model(path, torch.bfloat16), torch.bfloat16, 0.995),
        "fp8": (load_model(path, torch.float32, quantization="fp8"), torch.float8_e4m3fn, 0.95),
    }
    for name, (model, kv_dtype, floor) in variants.items():
        cos = torch.cosine_similarity(_paged_logits(model, kv_dtype), ref, dim=-1)
        assert float(cos.min()) > floor, f"{name}: {cos.tolist()}"


def test_engine_greedy_matches_transformers_generate(
    family: tuple[str, Path, PreTrainedModel],
) -> None:
    _, path, hf = family
    new_tokens = 8
    with torch.inference_mode():
        out = cast(Any, hf).generate(
            torch.tensor([PROMPT]), max_new_tokens=new_tokens, do_sample=False, pad_token_id=2
        )
    expected = out[0, len(PROMPT) :].tolist()  # up to EOS (id 1) where generate met it
    config = EngineConfig(
        model_dir=str(path), dtype="float32", num_kv_blocks=32, block_size=4,
        tune_linear_paths=False,
    )  # fmt: skip
    engine = LLMEngine(config)
    engine.add_request("r", PROMPT, SamplingParams(max_tokens=new_tokens, ignore_eos=True))
    assert tokens_of(run_to_completion(engine)["r"])[: len(expected)] == expected


@pytest.mark.parametrize("family", ["gemma2", "qwen3_qk_norm"], indirect=True)
def test_start_up_path_choice_times_the_family(family: tuple[str, Path, PreTrainedModel]) -> None:
    """The dtype choice at start builds a small copy of the model (its own weight
    reading); a decode past the window runs the windowed attention there."""
    _, path, _ = family
    steps = [Workload("decode", 2, 1, 3 * WINDOW), Workload("prefill", 1, 2 * WINDOW, 0)]
    result = measure(
        path, (torch.float32, torch.bfloat16), steps, lambda dt: dt, block_size=4, layers=2
    )
    assert set(result.timings_ms) == {"float32", "bfloat16"}
    assert all(ms > 0 for t in result.timings_ms.values() for ms in t.values())


def _write_config(path: Path, **raw: Any) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({**SHAPE, **raw}))
    return path


def test_unsupported_architecture_is_refused_naming_it_and_the_supported_list(
    tmp_path: Path,
) -> None:
    path = _write_config(tmp_path / "phi", architectures=["PhiForCausalLM"], model_type="phi")
    with pytest.raises(ValueError, match="PhiForCausalLM") as err:
        load_model_config(path)
    for arch in SUPPORTED_ARCHITECTURES:
        assert arch in str(err.value)
    # at engine start, before any weight is read
    with pytest.raises(ValueError, match="PhiForCausalLM is not supported"):
        LLMEngine(EngineConfig(model_dir=str(path), dtype="float32", tune_linear_paths=False))


def test_architecture_from_model_type_and_unsupported_features_refused(tmp_path: Path) -> None:
    qwen3 = load_model_config(_write_config(tmp_path / "q3", model_type="qwen3"))
    assert (qwen3.family, qwen3.qk_norm) == ("qwen3", True)
    with pytest.raises(ValueError, match="model_type 'gpt2'"):
        load_model_config(_write_config(tmp_path / "g", model_type="gpt2"))
    with pytest.raises(ValueError, match="activation 'gelu'"):
        load_model_config(_write_config(tmp_path / "a", model_type="llama", hidden_act="gelu"))
    with pytest.raises(ValueError, match="rope_type 'yarn'"):
        load_model_config(
            _write_config(tmp_path / "y", model_type="llama", rope_scaling={"rope_type": "yarn"})
        )
