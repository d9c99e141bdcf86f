"""Model preparation: verified by checksum, idempotent, detects tampering."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from engine_tools import prepare_model


def test_prepared_model_verifies(model_dir: Path) -> None:
    ok, reason = prepare_model.verify(model_dir)
    assert ok, reason
    manifest = json.loads((model_dir / "manifest.json").read_text())
    assert set(manifest["files"]) == set(prepare_model.MODEL_FILES)
    assert manifest["source"]["sha256"] == prepare_model.sha256_file(prepare_model.find_gguf())


def test_config_is_a_standard_llama_checkpoint(model_dir: Path) -> None:
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in cfg
    assert cfg["rope_theta"] == pytest.approx(100000.0)
    assert cfg["tie_word_embeddings"] is True
    tc = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tc["chat_template"]
    assert tc["tokenizer_class"] == "PreTrainedTokenizerFast"
    gen = json.loads((model_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 2


def test_second_run_is_a_no_op(model_dir: Path) -> None:
    before = (model_dir / "model.safetensors").stat().st_mtime_ns
    assert prepare_model.prepare(model_dir) == model_dir
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == before


def test_tampering_is_detected(model_dir: Path, tmp_path: Path) -> None:
    copy = tmp_path / "m"
    copy.mkdir()
    for name in [*prepare_model.MODEL_FILES, "manifest.json"]:
        if name != "model.safetensors":
            shutil.copy(model_dir / name, copy / name)
    (copy / "model.safetensors").symlink_to(model_dir / "model.safetensors")
    assert prepare_model.verify(copy) == (True, "ok")
    cfg = copy / "config.json"
    cfg.write_text(cfg.read_text().replace('"silu"', '"gelu"'))
    ok, reason = prepare_model.verify(copy)
    assert not ok
    assert "config.json" in reason
    (copy / "tokenizer.json").unlink()
    assert prepare_model.verify(copy)[1] in (
        "tokenizer.json is missing",
        "config.json does not match its checksum",
    )
    assert prepare_model.verify(tmp_path)[1] == "no manifest"


@pytest.mark.slow
def test_converted_model_answers_coherently(model_dir: Path) -> None:
    """Greedy output of the converted checkpoint (through the transformers reference)."""
    import torch
    import transformers

    tok: Any = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tok.apply_chat_template(
        msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=12, do_sample=False)
    answer = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer
