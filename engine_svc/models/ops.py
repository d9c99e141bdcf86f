"""The decoder's small fused operators: compiled CPU kernels, or torch equivalents.

Each function calls ``torch.ops.llm_cpu.*`` (``csrc/``, one source per op family) when the
kernels are built and the tensors are on the CPU, and otherwise runs the
pure-torch version here, which is also the reference the kernel tests compare
against. A layer then costs a handful of calls instead of ~40 small ones.
"""

from __future__ import annotations

import functools
from typing import cast

import torch
import torch.nn.functional as F

from engine_svc.models import cpu_kernels, kv_fp8


def _native(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and cpu_kernels.ops_available()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of the last dimension, computed in fp32, returned in ``x.dtype``."""
    if _native(x) and x.dtype in (torch.float32, torch.bfloat16):
        return cast(torch.Tensor, torch.ops.llm_cpu.rms_norm(x.contiguous(), weight, eps))
    out = F.rms_norm(x.float(), (x.shape[-1],), None, eps) * weight.float()
    return out.to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """``residual += x`` in place, then ``rms_norm(residual)``."""
    if _native(x) and x.dtype in (torch.float32, torch.bfloat16) and residual.is_contiguous():
        out = torch.ops.llm_cpu.add_rms_norm(x.contiguous(), residual, weight, eps)
        return cast(torch.Tensor, out)
    residual.add_(x)
    return rms_norm(residual, weight, eps)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``x = [gate | up]`` on the last dimension."""
    if _native(x) and x.dtype in (torch.float32, torch.bfloat16):
        return cast(torch.Tensor, torch.ops.llm_cpu.silu_and_mul(x.contiguous()))
    gate, up = x.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(gate) * up`` for ``x = [gate | up]`` (Gemma's GeGLU; torch only)."""
    gate, up = x.float().chunk(2, dim=-1)
    return (F.gelu(gate, approximate="tanh") * up).to(x.dtype)


def skinny_available(weight: torch.Tensor) -> bool:
    """True when ``skinny_linear`` runs the compiled kernel for this weight."""
    return _native(weight) and weight.dtype in (torch.float32, torch.bfloat16)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight^T`` for a few rows [M, K], streaming the weight [N, K] once."""
    if skinny_available(weight) and x.dtype == weight.dtype:
        return cast(torch.Tensor, torch.ops.llm_cpu.skinny_linear(x.contiguous(), weight))
    return F.linear(x, weight)


def amx_available(weight: torch.Tensor) -> bool:
    """True when ``amx_linear`` can run for this weight: a bf16 [N, K] with N and K
    multiples of 32, on a CPU (and kernel build) with AMX tiles the OS lets us use."""
    return (
        _native(weight)
        and weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and weight.shape[0] % 32 == 0
        and weight.shape[1] % 32 == 0
        and bool(torch.ops.llm_cpu.amx_available())
    )


def q4_available(dtype: torch.dtype = torch.bfloat16) -> bool:
    """True when ``q4_linear`` (4-bit packed weights, ``engine_svc.models.q4``) can run
    rows of ``dtype``: bf16 where the kernels are built for AVX512-BF16, fp32 for AVX2
    (with F16C) and up."""
    return cpu_kernels.ops_available() and bool(torch.ops.llm_cpu.q4_available(dtype))


def q4_applies(dtype: torch.dtype, device: torch.device) -> bool:
    """True when a weight of ``dtype`` on ``device`` may run on a 4-bit copy: bf16 or
    fp32 on a CPU whose kernel build has ``q4_linear`` for that dtype (the one gate for
    loader and ``Linear``)."""
    return dtype in (torch.bfloat16, torch.float32) and device.type == "cpu" and q4_available(dtype)


def q8_applies(dtype: torch.dtype, device: torch.device) -> bool:
    """True when a weight of ``dtype`` on ``device`` may run on an 8-bit copy
    (``q4.q8_pack``): fp32 on a CPU whose kernel build has the fp32 4-bit kernel."""
    return dtype == torch.float32 and device.type == "cpu" and q4_available(dtype)


def q8_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """``x @ W^T`` for fp32 rows [M, K] and an 8-bit packed W (``q4.q8_pack``)."""
    return cast(torch.Tensor, torch.ops.llm_cpu.q8_linear(x.contiguous(), packed))


def q4_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """``x @ W^T`` for bf16 or fp32 rows [M, K] and a 4-bit packed W (``q4.q4_pack``);
    the result has x's dtype."""
    return cast(torch.Tensor, torch.ops.llm_cpu.q4_linear(x.contiguous(), packed))


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` for fp32 [N, V] (first maximum wins), several times faster."""
    if _native(logits) and logits.dtype == torch.float32 and logits.dim() == 2:
        return cast(torch.Tensor, torch.ops.llm_cpu.argmax_rows(logits.contiguous()))
    return logits.argmax(dim=-1)


def rotary_qkv(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """RoPE on q and k of a fused projection, and the KV-cache write.

    Args:
        qkv: [T, (H + 2 * Hkv) * D] projection output (fp32 or bf16).
        cos, sin: fp32 tables [max_position, D / 2].
        positions, slot_mapping: [T] int64.
        k_cache, v_cache: [num_blocks, block_size, Hkv, D] caches (fp32, bf16,
            or float8_e4m3fn with ``kv_scales``) that receive k and v.
        num_heads, num_kv_heads: H and Hkv.
        kv_scales: per-head (k, v) scales [Hkv] of an FP8 cache.
        out_dtype: float32 (default) or bfloat16 for the result; the rotation
            and the cache write are computed in fp32 either way.

    Returns:
        [T, H + 2 * Hkv, D] in ``out_dtype``: rotated q, rotated k, then v.
    """
    ks, vs = kv_scales if kv_scales is not None else (None, None)
    if _native(qkv) and qkv.dtype in (torch.float32, torch.bfloat16):
        out = torch.ops.llm_cpu.rotary_qkv(
            qkv.contiguous(), cos, sin, positions, slot_mapping, k_cache, v_cache,
            num_heads, num_kv_heads, ks, vs, out_dtype,
        )  # fmt: skip
        return cast(torch.Tensor, out)
    t = qkv.shape[0]
    heads = num_heads + 2 * num_kv_heads
    x = qkv.float().view(t, heads, -1)
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    nqk = num_heads + num_kv_heads
    x1, x2 = x[:, :nqk].chunk(2, dim=-1)
    out = torch.cat((torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1), x[:, nqk:]), dim=1)
    k, v = out[:, num_heads:nqk], out[:, nqk:]
    if ks is not None and vs is not None:
        kv_fp8.write_kv(k_cache, slot_mapping, k, ks)
        kv_fp8.write_kv(v_cache, slot_mapping, v, vs)
    else:
        d = out.shape[-1]
        k_cache.view(-1, num_kv_heads, d).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
        v_cache.view(-1, num_kv_heads, d).index_copy_(0, slot_mapping, v.to(v_cache.dtype))
    return out if out_dtype is None else out.to(out_dtype)


def decode_forward(
    residual: torch.Tensor,
    in_norm: list[torch.Tensor],
    post_norm: list[torch.Tensor],
    weights: list[torch.Tensor],
    packed: list[torch.Tensor],
    small: list[torch.Tensor],
    skinny_max_rows: int,
    final_norm: torch.Tensor,
    eps: float,
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    kv_scales: list[tuple[torch.Tensor, torch.Tensor]] | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
) -> torch.Tensor:
    """A whole decode-only step of the decoder in one compiled call (see csrc/decode_forward.cpp).

    ``weights`` holds qkv, o, gate_up, down of every layer in order (dense
    [N, K]); ``packed`` their packed copies (AMX tile order or oneDNN's) in the
    same order, or is empty; ``small`` their 4-bit copies, which serve steps of
    up to ``skinny_max_rows`` rows, or is empty (the bf16/fp32 GEMV serves them).
    ``residual`` is the embedding output and is updated in place. Returns the
    final-norm hidden states [B, hidden].
    """
    scales = [s for pair in kv_scales for s in pair] if kv_scales is not None else []
    out = torch.ops.llm_cpu.decode_forward(
        residual, in_norm, post_norm, weights, packed, small, skinny_max_rows, final_norm, eps,
        [k for k, _ in kv_caches], [v for _, v in kv_caches], scales, cos, sin, positions,
        slot_mapping, block_tables, context_lens, num_heads, num_kv_heads,
    )  # fmt: skip
    return cast(torch.Tensor, out)


def decode_forward_usable(x: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """True when ``decode_forward`` can run for activations ``x`` and this KV cache."""
    return (
        _native(x)
        and x.dtype in (torch.float32, torch.bfloat16)
        and k_cache.dtype in KERNEL_KV_DTYPES
    )


KERNEL_KV_DTYPES = (torch.float32, torch.bfloat16, torch.float8_e4m3fn)


def decode_kernel_usable(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """True when ``paged_decode_attention`` runs the compiled kernel for these tensors."""
    return _native(q) and k_cache.dtype in KERNEL_KV_DTYPES


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    out_dtype: torch.dtype = torch.float32,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Decode attention read through block tables by the compiled kernel.

    Args:
        q: fp32 [B, H, D] (heads contiguous; rows may be strided).
        k_cache, v_cache: [num_blocks, block_size, Hkv, D] fp32, bf16, or
            float8_e4m3fn with ``kv_scales``.
        block_tables: [B, max_blocks] int64; context_lens: [B] int64.
        out_dtype: dtype of the returned [B, H * D].
        kv_scales: per-head (k, v) scales [Hkv] of an FP8 cache.
    """
    if q.stride(-1) != 1 or q.stride(1) != q.shape[2]:
        q = q.contiguous()
    ks, vs = kv_scales if kv_scales is not None else (None, None)
    out = torch.ops.llm_cpu.paged_decode_attention(
        q, k_cache, v_cache, block_tables, context_lens, q.shape[-1] ** -0.5, out_dtype, ks, vs
    )
    return cast(torch.Tensor, out)


def prefill_kernel_dtype() -> torch.dtype | None:
    """The q dtype the fused prefill attention takes on this CPU: bf16 where the kernel
    build has AVX512-BF16 (AMX too where present), else fp32 where it has AVX2; None
    where neither kernel is built."""
    return _built_prefill_dtype() if cpu_kernels.ops_available() else None


def prefill_kernel_caches() -> tuple[torch.dtype, ...]:
    """The cache dtypes the fused prefill kernel reads: bf16 for the bf16 kernel, bf16
    or fp32 for the fp32 one (none where neither is built)."""
    dtype = prefill_kernel_dtype()
    if dtype is None:
        return ()
    return (torch.bfloat16,) if dtype == torch.bfloat16 else (torch.bfloat16, torch.float32)


def prefill_kernel_label() -> str:
    """``amx bfloat16``, ``avx512_bf16 bfloat16`` or ``avx2 float32``: which fused prefill
    kernel runs here, for logs and model info."""
    if prefill_kernel_dtype() == torch.float32:
        return "avx2 float32"
    return f"{'amx' if cpu_kernels.kernel_tier() == 'amx' else 'avx512_bf16'} bfloat16"


@functools.cache
def _built_prefill_dtype() -> torch.dtype | None:
    if torch.ops.llm_cpu.prefill_attention_available():
        return torch.bfloat16
    if torch.ops.llm_cpu.prefill_attention_f32_available():
        return torch.float32
    return None


def prefill_kernel_usable(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None,
) -> bool:
    """True when ``prefill_attention`` can run: a paged cache with a block size a
    multiple of 16 and head dim 64 or 128, on a CPU with a fused kernel
    (``prefill_kernel_dtype``): the bf16 kernel reads a bf16 cache, the fp32 one a
    bf16 or fp32 cache."""
    return (
        _native(q)
        and kv_scales is None
        and k_cache.dtype in prefill_kernel_caches()
        and k_cache.shape[1] % 16 == 0
        and k_cache.shape[3] in (64, 128)
        and q.shape[1] % k_cache.shape[2] == 0
    )


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seqs: torch.Tensor,
    tables: torch.Tensor,
) -> torch.Tensor:
    """Causal prefill attention of a step's chunks over their paged contexts, fused.

    Args:
        q: [T, H, D] prefill rows (cast to ``prefill_kernel_dtype()``; heads
            contiguous, rows may be strided).
        k_cache, v_cache: [num_blocks, block_size, Hkv, D] bf16 (or fp32 for the
            fp32 kernel), already holding the chunks' own K/V.
        seqs: [S, 3] int64: first row, length and cached tokens of each chunk.
        tables: [S, W] int64 block tables covering each chunk's context.

    Returns:
        [T, H * D] in the kernel's dtype.
    """
    dtype = prefill_kernel_dtype() or torch.bfloat16
    if q.dtype != dtype:
        q = q.to(dtype)
    if q.stride(-1) != 1 or q.stride(1) != q.shape[2]:
        q = q.contiguous()
    out = torch.ops.llm_cpu.prefill_attention(
        q, k_cache, v_cache, seqs, tables, q.shape[-1] ** -0.5
    )
    return cast(torch.Tensor, out)
