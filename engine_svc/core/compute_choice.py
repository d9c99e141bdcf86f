"""How the engine computes on this machine: weight dtype, KV dtype, CPU tier.

The weight dtype is forced by the config, fixed by the device, or measured on
this CPU at the batches this engine's scheduler makes (``path_choice``): a
choice made at one row can be the slowest at 32.
"""

from __future__ import annotations

import logging
from functools import partial

import torch

from engine_svc.core.config import EngineConfig
from engine_svc.models import loader, path_choice
from engine_svc.models.linear import LinearChoice
from engine_svc.models.loader import resolve_dtype

logger = logging.getLogger(__name__)

_CPU_CANDIDATES = (torch.float32, torch.bfloat16)  # the conservative one first: it wins ties


def choose_linear(config: EngineConfig, model_dir: str, device: torch.device) -> LinearChoice:
    """Weight dtype and matmul form: measured on this CPU, at the batches this engine's
    scheduler makes (``path_choice``), unless the config forces them."""
    if config.dtype != "auto":
        return LinearChoice(resolve_dtype(config.dtype), "forced")
    if device.type != "cpu":
        return LinearChoice(torch.bfloat16, "device")
    if config.quantization == "fp8":  # FP8 projections have their own kernels
        return LinearChoice(torch.bfloat16, "fp8")
    sched = config.scheduler
    chunk = sched.max_num_batched_tokens
    if sched.long_prefill_token_threshold:
        chunk = min(chunk, sched.long_prefill_token_threshold)
    result = path_choice.measure(
        model_dir,
        _CPU_CANDIDATES,
        path_choice.workloads(sched.max_num_seqs, chunk),
        partial(kv_cache_dtype, config.kv_cache_dtype, attn_dtype=torch.float32),
        q4_weights=config.q4_weights and config.tune_linear_paths,
        block_size=config.block_size,
    )
    logger.info("weight dtype: %s (measured: %s)", result.name, result.reason)
    return LinearChoice(loader.DTYPES[result.name], "benchmark", detail=result.reason)


_KV_DTYPES = {"fp8": torch.float8_e4m3fn, "bfloat16": torch.bfloat16, "float32": torch.float32}


def kv_cache_dtype(name: str, weight_dtype: torch.dtype, attn_dtype: torch.dtype) -> torch.dtype:
    """``auto``: bf16 beside bf16 weights (half the bytes every decode step reads), else the
    attention dtype; or an explicit ``bfloat16``, ``float32`` or ``fp8``.

    Raises:
        ValueError: an unknown name.
    """
    if name == "auto":
        return torch.bfloat16 if weight_dtype == torch.bfloat16 else attn_dtype
    if name not in _KV_DTYPES:
        raise ValueError(f"kv_cache_dtype {name!r}: use 'auto', {', '.join(map(repr, _KV_DTYPES))}")
    return _KV_DTYPES[name]
