"""engine_svc.backends.checkpoint: GetModelInfo's fields read from a checkpoint's files."""

from __future__ import annotations

import json
from pathlib import Path

from engine_svc.backends.checkpoint import model_info_from_dir
from engine_svc.core.config import EngineConfig


def test_the_real_checkpoint_is_described_by_its_config_files(model_dir: Path) -> None:
    hf = json.loads((model_dir / "config.json").read_text())
    info = model_info_from_dir(model_dir, EngineConfig(), "vllm")
    assert (info.model, info.backend) == (model_dir.name, "vllm")
    assert info.vocab_size == hf["vocab_size"]
    assert info.max_context_length == hf["max_position_embeddings"]
    assert info.eos_token_ids  # generation_config.json or config.json names one


def test_the_config_caps_the_context_and_a_list_of_eos_ids_is_kept(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps({"vocab_size": 10, "max_position_embeddings": 4096, "eos_token_id": 2})
    )
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    info = model_info_from_dir(tmp_path, EngineConfig(max_model_len=1024, block_size=8), "x")
    assert info.max_context_length == 1024
    assert info.eos_token_ids == [2, 7]
    assert info.kv_block_size == 8
    # a cap above the model's own context is the model's
    assert (
        model_info_from_dir(tmp_path, EngineConfig(max_model_len=10**6), "x").max_context_length
        == 4096
    )
