"""Fixtures for the native engine tests: a tiny random Llama and the real model."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from engine_svc.core import EngineConfig, LLMEngine, SchedulerConfig
from tests.support.engine_config import engine_config

TINY_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 96,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "hidden_act": "silu",
}


def _tiny_weights(cfg: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd, nq, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]

    def w(*shape: int, std: float = 0.25) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    out = {
        "model.embed_tokens.weight": w(v, h, std=1.0),
        "model.norm.weight": 1 + w(h, std=0.1),
        "lm_head.weight": w(v, h, std=0.5),
    }
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        out |= {
            p + "input_layernorm.weight": 1 + w(h, std=0.1),
            p + "post_attention_layernorm.weight": 1 + w(h, std=0.1),
            p + "self_attn.q_proj.weight": w(nq * hd, h),
            p + "self_attn.k_proj.weight": w(nkv * hd, h),
            p + "self_attn.v_proj.weight": w(nkv * hd, h),
            p + "self_attn.o_proj.weight": w(h, nq * hd),
            p + "mlp.gate_proj.weight": w(i, h),
            p + "mlp.up_proj.weight": w(i, h),
            p + "mlp.down_proj.weight": w(h, i),
        }
    return out


def write_tiny_model(path: Path, seed: int = 0, **overrides: Any) -> Path:
    """Write a random tiny Llama HF directory (config.json + model.safetensors)."""
    cfg = TINY_CONFIG | overrides
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 1}))
    save_file(_tiny_weights(cfg, seed), str(path / "model.safetensors"))
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


EngineFactory = Callable[..., LLMEngine]


@pytest.fixture
def make_tiny_engine(tiny_model_dir: Path) -> EngineFactory:
    """Build an fp32 CPU engine on the tiny model; keyword args override EngineConfig
    (the scheduler's knobs among them: ``tests.support.engine_config``)."""

    def make(**kwargs: Any) -> LLMEngine:
        base: dict[str, Any] = {
            "model_dir": str(tiny_model_dir),
            "dtype": "float32",
            "device": "cpu",
            "block_size": 4,
            "num_kv_blocks": 128,
            "max_num_batched_tokens": 64,
        }
        return LLMEngine(engine_config(**(base | kwargs)))

    return make


@pytest.fixture(scope="session")
def real_engine(model_dir: Path) -> Iterator[LLMEngine]:
    """The real model in fp32, loaded once per session (tests must leave it idle)."""
    engine = LLMEngine(
        EngineConfig(
            model_dir=str(model_dir),
            dtype="float32",
            device="cpu",
            num_kv_blocks=256,
            scheduler=SchedulerConfig(max_num_batched_tokens=256),
        )
    )
    yield engine
    assert not engine.has_unfinished_requests()
