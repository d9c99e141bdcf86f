"""Model configuration read from an HF checkpoint directory (config.json).

One decoder (``llama.py``) serves every supported family; what sets a family
apart is read here into flags: q/k/v bias (Qwen2, read from the weights), a
per-head RMSNorm of q and k (Qwen3, Gemma 3), Gemma's scaled embeddings,
``1 + w`` norms, GeGLU, norms around both sublayers, softcapping and query
scale, and sliding-window layers (Mistral, Gemma 2/3, Qwen with
``use_sliding_window``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine_svc.models.rotary import SUPPORTED_ROPE_TYPES

# architecture -> family; the families differ only in the flags ModelConfig carries
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)
_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}
SLIDING = "sliding_attention"


@dataclass(slots=True)
class ModelConfig:
    """What the engine needs of an HF decoder config.

    Attributes:
        rope_scaling: the HF ``rope_scaling`` / ``rope_parameters`` dict with its
            ``rope_type`` (``default``, ``linear``, ``llama3``), or None.
        eos_token_ids: EOS ids from generation_config.json (falls back to config.json).
        family: ``llama``, ``mistral``, ``qwen2``, ``qwen3``, ``gemma2`` or ``gemma3``.
        qk_norm: a per-head RMSNorm of q and k before RoPE (``q_norm``/``k_norm``).
        hidden_act: ``silu`` (SwiGLU) or ``gelu_pytorch_tanh`` (GeGLU).
        scale_embeddings: embeddings times sqrt(hidden_size) (Gemma).
        norm_offset: norm weights are stored as ``w`` for a scale of ``1 + w`` (Gemma).
        sandwich_norm: RMSNorm on each sublayer's output before the residual add, and a
            separate pre-feed-forward norm (Gemma 2/3).
        query_scale: the attention softmax scale; None = head_dim ** -0.5.
        attn_softcap: attention scores become ``cap * tanh(s / cap)``; None = off.
        final_softcap: the same on the final logits; None = off.
        sliding_window: keys within this many positions of the query (itself
            included) on the sliding layers; None = no sliding layers.
        layer_types: ``full_attention`` or ``sliding_attention`` per layer.
        local_rope_theta: RoPE base of the sliding layers when it differs (Gemma 3,
            no scaling there); None = the same RoPE as the full layers.
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
    family: str = "llama"
    qk_norm: bool = False
    hidden_act: str = "silu"
    scale_embeddings: bool = False
    norm_offset: bool = False
    sandwich_norm: bool = False
    query_scale: float | None = None
    attn_softcap: float | None = None
    final_softcap: float | None = None
    sliding_window: int | None = None
    layer_types: list[str] = field(default_factory=list)
    local_rope_theta: float | None = None

    def kv_bytes_per_token(self, dtype_size: int) -> int:
        """Bytes of K and V one token occupies across all layers."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * dtype_size

    def is_sliding(self, layer: int) -> bool:
        """True when ``layer`` attends only within the sliding window."""
        return (
            self.sliding_window is not None
            and layer < len(self.layer_types)
            and self.layer_types[layer] == SLIDING
        )


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _rope(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    params = raw.get("rope_parameters") or {}
    if "full_attention" in params:  # per layer type (Gemma 3 as transformers 5 writes it)
        params = params["full_attention"] or {}
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


def _architecture(raw: dict[str, Any], path: Path) -> str:
    archs = raw.get("architectures") or [_BY_MODEL_TYPE.get(raw.get("model_type", ""), "")]
    for arch in archs:
        if arch in ARCHITECTURES:
            return str(arch)
    named = [a for a in archs if a] or [f"model_type {raw.get('model_type')!r}"]
    raise ValueError(
        f"{path}: architecture {', '.join(map(str, named))} is not supported by the native "
        f"engine; supported: {', '.join(SUPPORTED_ARCHITECTURES)} (serve other models "
        "through a vllm:// or trtllm:// engine)"
    )


def _sliding(raw: dict[str, Any], family: str, layers: int) -> tuple[int | None, list[str]]:
    """The window and the per-layer attention types."""
    window = raw.get("sliding_window")
    if family in ("qwen2", "qwen3") and not raw.get("use_sliding_window", False):
        window = None
    if family == "llama" or not window:
        return None, ["full_attention"] * layers
    types = raw.get("layer_types")
    if not types:
        if family == "gemma2":
            types = [SLIDING if i % 2 == 0 else "full_attention" for i in range(layers)]
        elif family == "gemma3":
            pattern = int(raw.get("sliding_window_pattern", 6))
            types = [SLIDING if (i + 1) % pattern else "full_attention" for i in range(layers)]
        elif family == "mistral":
            types = [SLIDING] * layers
        else:  # Qwen: the layers from max_window_layers on
            first = int(raw.get("max_window_layers", 0))
            types = [SLIDING if i >= first else "full_attention" for i in range(layers)]
    return int(window), [str(t) for t in types]


def _family_flags(raw: dict[str, Any], family: str) -> dict[str, Any]:
    gemma = family in ("gemma2", "gemma3")
    act = str(raw.get("hidden_activation") or raw.get("hidden_act") or "silu")
    allowed = "gelu_pytorch_tanh" if gemma else "silu"  # SwiGLU, or Gemma's GeGLU
    if act != allowed:
        raise ValueError(f"activation {act!r} is not supported for {family}; it takes {allowed}")
    if raw.get("mlp_bias"):
        raise ValueError("mlp_bias is not supported by the native engine")
    flags: dict[str, Any] = {
        "family": family,
        "hidden_act": act,
        "qk_norm": family in ("qwen3", "gemma3"),
        "scale_embeddings": gemma,
        "norm_offset": gemma,
        "sandwich_norm": gemma,
    }
    if gemma:
        flags["query_scale"] = float(raw.get("query_pre_attn_scalar") or 256) ** -0.5
        flags["attn_softcap"] = raw.get("attn_logit_softcapping") or None
        flags["final_softcap"] = raw.get("final_logit_softcapping") or None
    if family == "gemma3":
        local = (raw.get("rope_parameters") or {}).get(SLIDING) or {}
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"Gemma 3 sliding layers: rope_type {local['rope_type']!r}")
        flags["local_rope_theta"] = float(
            local.get("rope_theta") or raw.get("rope_local_base_freq") or 10000.0
        )
    return flags


def load_model_config(model_dir: str | Path) -> ModelConfig:
    """Read ``config.json`` (and ``generation_config.json`` when present).

    Raises:
        ValueError: the directory has no config.json, an unsupported architecture,
            or a feature of a supported one this engine does not implement.
    """
    path = Path(model_dir)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"{path} is not an HF checkpoint directory: config.json is missing")
    raw: dict[str, Any] = json.loads(cfg_file.read_text())
    family = ARCHITECTURES[_architecture(raw, path)]
    gen_file = path / "generation_config.json"
    gen: dict[str, Any] = json.loads(gen_file.read_text()) if gen_file.is_file() else {}
    eos = _as_id_list(gen.get("eos_token_id", raw.get("eos_token_id")))
    theta, scaling = _rope(raw)
    max_pos = int(raw.get("max_position_embeddings", 2048))
    if scaling is not None and scaling["rope_type"] == "dynamic":
        # dynamic NTK equals plain RoPE up to the original length; the engine stops there
        max_pos = min(max_pos, int(scaling.get("original_max_position_embeddings", max_pos)))
        scaling = None
    if scaling is not None and scaling["rope_type"] not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"{path}: rope_type {scaling['rope_type']!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    num_heads = int(raw["num_attention_heads"])
    hidden = int(raw["hidden_size"])
    layers = int(raw["num_hidden_layers"])
    window, types = _sliding(raw, family, layers)
    try:
        flags = _family_flags(raw, family)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    return ModelConfig(
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_hidden_layers=layers,
        num_attention_heads=num_heads,
        num_key_value_heads=int(raw.get("num_key_value_heads") or num_heads),
        head_dim=int(raw.get("head_dim") or hidden // num_heads),
        max_position_embeddings=max_pos,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", family.startswith("gemma"))),
        attention_bias=bool(raw.get("attention_bias", False)),
        eos_token_ids=eos,
        bos_token_id=raw.get("bos_token_id"),
        name=str(raw.get("_name_or_path") or path.name),
        sliding_window=window,
        layer_types=types,
        **flags,
    )
