"""bench.capacity: the template's arithmetic and its report (no engine runs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import capacity
from engine_svc.models.config import ModelConfig

SMOLLM2 = {  # SmolLM2-135M-Instruct's config.json, the fields the template reads
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
}


def smollm2() -> ModelConfig:
    return ModelConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    )


def test_kv_bytes_per_token_by_dtype() -> None:
    cfg = smollm2()
    # 30 layers x 2 (K, V) x 3 KV heads x 64 x bytes: 23,040 in bf16
    assert {
        d: cfg.kv_bytes_per_token(capacity.DTYPE_BYTES[d]) for d in ("fp32", "bf16", "fp8")
    } == {"fp32": 46080, "bf16": 23040, "fp8": 11520}


def test_parameters_and_weight_bytes() -> None:
    cfg = smollm2()
    linear, other = capacity.num_params(cfg)
    assert linear + other == 134_515_008  # SmolLM2-135M, tied embeddings counted once
    assert capacity.weight_bytes(cfg, "bf16") == 2 * (linear + other)
    fp8 = capacity.weight_bytes(cfg, "fp8")
    assert linear + 2 * other < fp8 < capacity.weight_bytes(cfg, "bf16")


def test_max_seqs_and_plan_account_for_every_byte() -> None:
    assert capacity.max_seqs(128, 512, 16) == 4
    assert capacity.max_seqs(128, 513, 16) == 3  # a partial block is a whole block
    args = capacity.parse_args(["--memory-gib", "2", "--weight-dtype", "bf16"])
    cfg = smollm2()
    b16 = capacity.plan(cfg, args, "bf16", overhead=256 << 20)
    b8 = capacity.plan(cfg, args, "fp8", overhead=256 << 20)
    assert b16.weights + b16.activations + b16.runtime_overhead + b16.kv_pool == b16.memory
    assert b16.num_blocks == b16.kv_pool // (23040 * 16)
    assert b8.num_blocks == pytest.approx(2 * b16.num_blocks, abs=1)
    tiny = capacity.plan(cfg, capacity.parse_args(["--memory-gib", "0.1"]), "fp32", 0)
    assert tiny.kv_pool == 0
    assert tiny.num_blocks == 0  # the weights alone do not fit: no KV at all


def test_main_writes_table_json_and_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(SMOLLM2))
    out = tmp_path / "out"
    assert (
        capacity.main(
            [
                "--model-dir",
                str(model),
                "--out",
                str(out),
                "--memory-gib",
                "4",
                "--contexts",
                "512,2048",
                "--runtime-overhead-mib",
                "300",
            ]
        )
        == 0
    )
    report = json.loads((out / "capacity.json").read_text())
    assert (out / "capacity.png").stat().st_size > 10_000
    assert [b["kv_dtype"] for b in report["budgets"]] == ["fp32", "bf16", "fp8"]
    fp32, bf16, fp8 = report["budgets"]
    assert fp32["max_seqs"][0] * 4 == pytest.approx(fp32["max_seqs"][1] * 16, rel=0.05)
    assert fp32["max_seqs"][1] < bf16["max_seqs"][1] < fp8["max_seqs"][1]
    assert all(s <= report["max_num_seqs"] for s in fp8["max_seqs_capped"])
    assert report["measured"] is None
    assert "KV B/token" in capsys.readouterr().out
