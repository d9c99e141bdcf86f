"""How the engine computes on this machine: weight dtype, KV dtype, CPU tier.

The weight dtype is forced by the config, fixed by the device, or measured on
this CPU at the batches this engine's scheduler makes (``path_choice``): a
choice made at one row can be the slowest at 32. The loaded projections' paths
and the prefill attention are measured too (``prepare_model``); what all of it
decided is kept on disk (``compute_cache``) so the next start on this machine,
with this model, these settings and this code, applies it without timing.
"""

from __future__ import annotations

import logging
import os
from functools import partial

import torch

from engine_svc.core.config import EngineConfig
from engine_svc.models import compute_cache, cpu_kernels, loader, path_choice
from engine_svc.models.attention import choose_prefill_dtype, choose_prefill_kernel
from engine_svc.models.compute_cache import ComputeCache, Decision
from engine_svc.models.linear import LinearChoice, apply_choice, tune_linears
from engine_svc.models.llama import LlamaForCausalLM
from engine_svc.models.loader import load_model, resolve_dtype

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
        partial(
            kv_cache_dtype,
            config.kv_cache_dtype,
            attn_dtype=torch.float32,
            kernels_read_bf16=kernels_widen_bf16_kv(config, device),
        ),
        q4_weights=config.q4_weights and config.tune_linear_paths,
        block_size=config.block_size,
    )
    logger.info("weight dtype: %s (measured: %s)", result.name, result.reason)
    return LinearChoice(loader.DTYPES[result.name], "benchmark", detail=result.reason)


_KV_DTYPES = {"fp8": torch.float8_e4m3fn, "bfloat16": torch.bfloat16, "float32": torch.float32}


def kv_cache_dtype(
    name: str, weight_dtype: torch.dtype, attn_dtype: torch.dtype, kernels_read_bf16: bool = False
) -> torch.dtype:
    """``auto``: bf16 (half the bytes every decode step reads) beside bf16 weights, or where
    ``kernels_read_bf16`` (``kernels_widen_bf16_kv``: the compiled CPU attention kernels
    widen bf16 rows to fp32 in registers, so fp32 weights keep fp32 math); else the
    attention dtype. Or an explicit ``bfloat16``, ``float32`` or ``fp8``.

    Raises:
        ValueError: an unknown name.
    """
    if name == "auto":
        bf16 = weight_dtype == torch.bfloat16 or kernels_read_bf16
        return torch.bfloat16 if bf16 else attn_dtype
    if name not in _KV_DTYPES:
        raise ValueError(f"kv_cache_dtype {name!r}: use 'auto', {', '.join(map(repr, _KV_DTYPES))}")
    return _KV_DTYPES[name]


def kernels_widen_bf16_kv(config: EngineConfig, device: torch.device) -> bool:
    """True when ``auto`` gives fp32 weights a bf16 cache: the weight dtype is the engine's
    own choice (``dtype: auto``; a forced ``float32`` keeps fp32 KV, as vLLM's ``auto``
    does) and the compiled CPU kernels read the cache. On an AVX2 CPU, 32 decodes of ~350
    tokens spend 13.7 ms of attention a step reading bf16 against 22.9 ms reading fp32."""
    return config.dtype == "auto" and device.type == "cpu" and cpu_kernels.ops_available()


def _cache(config: EngineConfig, model_dir: str) -> ComputeCache | None:
    directory = compute_cache.resolve_dir(config.compute_cache_dir)
    if directory is None:
        return None
    sched = config.scheduler
    settings = {
        "dtype": config.dtype,
        "quantization": config.quantization,
        "q4_weights": config.q4_weights,
        "kv_cache_dtype": config.kv_cache_dtype,
        "block_size": config.block_size,
        "max_num_seqs": sched.max_num_seqs,
        "max_num_batched_tokens": sched.max_num_batched_tokens,
        "long_prefill_token_threshold": sched.long_prefill_token_threshold,
        "cpu_isa": config.cpu_isa,
    }
    return ComputeCache(directory, compute_cache.cache_key(model_dir, settings))


def _load(
    config: EngineConfig, model_dir: str, device: torch.device, dtype: torch.dtype
) -> LlamaForCausalLM:
    return load_model(
        model_dir,
        dtype,
        device,
        quantization=config.quantization,
        q4_weights=config.q4_weights and config.tune_linear_paths,
    )


def _measure(
    config: EngineConfig, model_dir: str, device: torch.device
) -> tuple[LlamaForCausalLM, LinearChoice, torch.dtype]:
    choice = choose_linear(config, model_dir, device)
    model = _load(config, model_dir, device, choice.dtype)
    mc = model.config
    if device.type == "cpu" and config.tune_linear_paths:
        tune_linears(model.linears(), choice)
        candidates = tuple(dict.fromkeys((torch.float32, choice.dtype)))
        dtype, timings = choose_prefill_dtype(
            mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim, candidates
        )
        model.prefill_attn_dtype = dtype
        logger.info("prefill attention: %s (ms per 512-token prompt: %s)", dtype, timings)
    kv_dtype = kv_cache_dtype(
        config.kv_cache_dtype, choice.dtype, model.attn_dtype, kernels_widen_bf16_kv(config, device)
    )
    if device.type == "cpu" and config.tune_linear_paths:
        fused, ms = choose_prefill_kernel(
            mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim,
            model.prefill_attn_dtype or model.attn_dtype, kv_dtype, config.block_size,
        )  # fmt: skip
        model.prefill_attn_kernel = fused
        if ms:
            logger.info("prefill attention fused: %s (ms per 512-token prompt: %s)", fused, ms)
    return model, choice, kv_dtype


def _decision(model: LlamaForCausalLM, choice: LinearChoice) -> Decision:
    return Decision(
        dtype=str(choice.dtype).removeprefix("torch."),
        reason=choice.reason,
        detail=choice.detail,
        packing=choice.packing,
        skinny_max_rows=choice.skinny_max_rows,
        q4_max_rows=choice.q4_max_rows,
        q8_max_rows=choice.q8_max_rows,
        prefill_attn_dtype=str(model.prefill_attn_dtype or "").removeprefix("torch."),
        prefill_fused=bool(model.prefill_attn_kernel),
    )


def _apply(
    config: EngineConfig, model_dir: str, device: torch.device, d: Decision
) -> tuple[LlamaForCausalLM, LinearChoice, torch.dtype]:
    choice = LinearChoice(
        loader.DTYPES[d.dtype],
        d.reason,
        packed=bool(d.packing),
        packing=d.packing,
        skinny_max_rows=d.skinny_max_rows,
        q4_max_rows=d.q4_max_rows,
        q8_max_rows=d.q8_max_rows,
        detail=f"{d.detail} (cached, measured at load {d.load_average:.1f})".lstrip(),
    )
    model = _load(config, model_dir, device, choice.dtype)
    apply_choice(model.linears(), choice)
    if d.prefill_attn_dtype:
        model.prefill_attn_dtype = loader.DTYPES[d.prefill_attn_dtype]
    model.prefill_attn_kernel = d.prefill_fused
    kv_dtype = kv_cache_dtype(
        config.kv_cache_dtype, choice.dtype, model.attn_dtype, kernels_widen_bf16_kv(config, device)
    )
    return model, choice, kv_dtype


def prepare_model(
    config: EngineConfig, model_dir: str, device: torch.device
) -> tuple[LlamaForCausalLM, LinearChoice, torch.dtype]:
    """Load the model with the dtype, projection paths and prefill attention measured
    on this machine, or kept from the last measurement (``compute_cache``).

    Returns:
        the model, its linear choice and the KV cache dtype.
    """
    cache = None
    if device.type == "cpu" and config.tune_linear_paths:
        cache = _cache(config, model_dir)
    decision = cache.load() if cache is not None else None
    if decision is not None and compute_cache.remeasure(
        decision, compute_cache.load_average(), os.cpu_count() or 1
    ):
        logger.info(
            "compute choice: %s was measured at load %.1f; quieter now, measuring again",
            cache.path if cache is not None else "",
            decision.load_average,
        )
        decision = None
    if cache is not None and decision is not None:
        logger.info("compute choice: from %s (measured before on this machine)", cache.path)
        return _apply(config, model_dir, device, decision)
    model, choice, kv_dtype = _measure(config, model_dir, device)
    if cache is not None:
        cache.store(_decision(model, choice))
    return model, choice, kv_dtype
