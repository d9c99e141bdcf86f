"""What a backend that loads a Hugging Face checkpoint itself (vLLM) reports before
its engine has said more: read from the checkpoint's config files."""

from __future__ import annotations

import json
from pathlib import Path

from engine_svc.core.config import EngineConfig
from engine_svc.core.outputs import ModelInfo


def model_info_from_dir(model_dir: Path, cfg: EngineConfig, backend: str) -> ModelInfo:
    """GetModelInfo's fields from ``config.json`` (and ``generation_config.json``
    where present): context length, vocabulary, end-of-sequence ids and the
    checkpoint's dtype; the caller replaces what its engine knows better."""
    hf = json.loads((model_dir / "config.json").read_text())
    gen_path = model_dir / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.exists() else {}
    eos = gen.get("eos_token_id", hf.get("eos_token_id"))
    eos_ids = eos if isinstance(eos, list) else ([eos] if eos is not None else [])
    max_len = int(hf.get("max_position_embeddings", 0))
    dtype = str(hf.get("torch_dtype", "bfloat16"))
    return ModelInfo(
        model=model_dir.name,
        backend=backend,
        kv_cache_dtype=dtype,
        max_context_length=min(cfg.max_model_len or max_len, max_len),
        vocab_size=int(hf.get("vocab_size", 0)),
        eos_token_ids=[int(i) for i in eos_ids],
        weight_dtype=dtype,
        kv_block_size=cfg.block_size,
    )
