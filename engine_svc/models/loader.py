"""Load an HF checkpoint directory (config.json + *.safetensors) into a model."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from engine_svc.models import ops
from engine_svc.models.config import ModelConfig, load_model_config
from engine_svc.models.llama import LlamaForCausalLM

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str) -> torch.dtype:
    """Map a dtype name (``float32``, ``bfloat16``, ``float16``) to torch.

    Raises:
        ValueError: an unknown name.
    """
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype {name!r} is not supported; choose one of {list(DTYPES)}") from None


def _required_names(config: ModelConfig) -> list[str]:
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        names += [p + f"self_attn.{n}_proj.weight" for n in "qkvo"]
        names += [p + f"mlp.{n}_proj.weight" for n in ("gate", "up", "down")]
        if config.qk_norm:
            names += [p + f"self_attn.{n}_norm.weight" for n in "qk"]
        if config.sandwich_norm:
            names += [p + f"{n}_feedforward_layernorm.weight" for n in ("pre", "post")]
    if not config.tie_word_embeddings:
        names.append("lm_head.weight")
    return names


def load_weights(
    model_dir: str | Path, config: ModelConfig, dtype: torch.dtype, device: torch.device
) -> dict[str, torch.Tensor]:
    """Read every safetensors shard, cast to ``dtype`` and move to ``device``.

    Raises:
        ValueError: no safetensors files, or tensors the config needs are missing.
    """
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir}: no *.safetensors weight files found")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():  # noqa: SIM118 - safe_open is not a mapping
                if name.startswith("model.") or name == "lm_head.weight":
                    weights[name] = sf.get_tensor(name).to(device=device, dtype=dtype)
    missing = [n for n in _required_names(config) if n not in weights]
    if missing:
        raise ValueError(f"{model_dir}: {len(missing)} weight(s) missing, e.g. {missing[:3]}")
    return weights


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    attn_dtype: torch.dtype | None = None,
    quantization: str = "none",
    q4_weights: bool = False,
) -> LlamaForCausalLM:
    """Build a ``LlamaForCausalLM`` from an HF directory.

    Args:
        model_dir: directory with config.json and safetensors weights.
        dtype: weight dtype.
        device: target device.
        attn_dtype: attention / KV dtype; default fp32 on CPU, ``dtype`` elsewhere.
        quantization: ``none``, or ``fp8`` for per-output-channel e4m3 weights in
            every decoder projection (embeddings, norms and LM head keep ``dtype``).
        q4_weights: also keep a lossless 4-bit packing of every projection that is
            exactly 4-bit per block (``q4.py``) for the path tuning to choose; only
            for bf16 or fp32 weights without quantization on a CPU whose kernel
            build has the q4 kernel for that dtype (``ops.q4_applies``).

    Raises:
        ValueError: an unknown quantization.
    """
    if quantization not in ("none", "fp8"):
        raise ValueError(f"quantization {quantization!r} is not supported; use 'none' or 'fp8'")
    dev = torch.device(device)
    config = load_model_config(model_dir)
    if attn_dtype is None:
        attn_dtype = torch.float32 if dev.type == "cpu" else dtype
    if not (q4_weights and quantization == "none" and ops.q4_applies(dtype, dev)):
        weights = load_weights(model_dir, config, dtype, dev)
        return LlamaForCausalLM(config, weights, attn_dtype, fp8=quantization == "fp8")
    exact = load_weights(model_dir, config, torch.float32, dev)
    weights = {name: t.to(dtype) for name, t in exact.items()}
    return LlamaForCausalLM(config, weights, attn_dtype, exact=exact)
