"""Model configuration read from an HF checkpoint directory (config.json)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")


@dataclass(slots=True)
class ModelConfig:
    """The subset of an HF Llama config the engine needs.

    Attributes:
        rope_scaling: the HF ``rope_scaling`` / ``rope_parameters`` dict with its
            ``rope_type`` (``default``, ``linear``, ``llama3``), or None.
        eos_token_ids: EOS ids from generation_config.json (falls back to config.json).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    name: str = ""

    def kv_bytes_per_token(self, dtype_size: int) -> int:
        """Bytes of K and V one token occupies across all layers."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * dtype_size


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _rope(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or None
    theta = float(raw.get("rope_theta") or params.get("rope_theta") or 10000.0)
    if scaling is None and params.get("rope_type", "default") != "default":
        scaling = dict(params)
    if scaling is not None:
        scaling = dict(scaling)
        scaling.setdefault("rope_type", scaling.get("type", "default"))
        if scaling["rope_type"] == "default":
            scaling = None
    return theta, scaling


def load_model_config(model_dir: str | Path) -> ModelConfig:
    """Read ``config.json`` (and ``generation_config.json`` when present).

    Raises:
        ValueError: the directory has no config.json or an unsupported architecture.
    """
    path = Path(model_dir)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"{path} is not an HF checkpoint directory: config.json is missing")
    raw: dict[str, Any] = json.loads(cfg_file.read_text())
    archs = raw.get("architectures") or ["LlamaForCausalLM"]
    if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        raise ValueError(
            f"{path}: architecture {archs} is not supported; "
            f"supported: {list(SUPPORTED_ARCHITECTURES)}"
        )
    gen_file = path / "generation_config.json"
    gen: dict[str, Any] = json.loads(gen_file.read_text()) if gen_file.is_file() else {}
    eos = _as_id_list(gen.get("eos_token_id", raw.get("eos_token_id")))
    theta, scaling = _rope(raw)
    num_heads = int(raw["num_attention_heads"])
    hidden = int(raw["hidden_size"])
    return ModelConfig(
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_hidden_layers=int(raw["num_hidden_layers"]),
        num_attention_heads=num_heads,
        num_key_value_heads=int(raw.get("num_key_value_heads") or num_heads),
        head_dim=int(raw.get("head_dim") or hidden // num_heads),
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=bool(raw.get("attention_bias", False)),
        mlp_bias=bool(raw.get("mlp_bias", False)),
        eos_token_ids=eos,
        bos_token_id=raw.get("bos_token_id"),
        name=str(raw.get("_name_or_path") or path.name),
    )
