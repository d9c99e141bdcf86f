"""The decoder's small fused operators: compiled CPU kernels, or torch equivalents.

Each function calls ``torch.ops.llm_cpu.*`` (``csrc/cpu_ops.cpp``) when the
kernels are built and the tensors are on the CPU, and otherwise runs the
pure-torch version here, which is also the reference the kernel tests compare
against. A layer then costs a handful of calls instead of ~40 small ones.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F

from engine_svc.models import cpu_kernels


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


def skinny_available(weight: torch.Tensor) -> bool:
    """True when ``skinny_linear`` runs the compiled kernel for this weight."""
    return _native(weight) and weight.dtype in (torch.float32, torch.bfloat16)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight^T`` for a few rows [M, K], streaming the weight [N, K] once."""
    if skinny_available(weight) and x.dtype == weight.dtype:
        return cast(torch.Tensor, torch.ops.llm_cpu.skinny_linear(x.contiguous(), weight))
    return F.linear(x, weight)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` for fp32 [N, V] (first maximum wins), several times faster."""
    if _native(logits) and logits.dtype == torch.float32 and logits.dim() == 2:
        return cast(torch.Tensor, torch.ops.llm_cpu.argmax_rows(logits.contiguous()))
    return logits.argmax(dim=-1)


def _writable_cache(cache: torch.Tensor | None) -> bool:
    return cache is not None and cache.dtype in (torch.float32, torch.bfloat16)


def rotary_qkv(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_cache: torch.Tensor | None,
    v_cache: torch.Tensor | None,
    num_heads: int,
    num_kv_heads: int,
) -> torch.Tensor:
    """RoPE on q and k of a fused projection, and the KV-cache write.

    Args:
        qkv: [T, (H + 2 * Hkv) * D] projection output (fp32 or bf16).
        cos, sin: fp32 tables [max_position, D / 2].
        positions, slot_mapping: [T] int64.
        k_cache, v_cache: [num_blocks, block_size, Hkv, D] fp32/bf16 caches to
            write k and v into, or None (the caller writes, e.g. an FP8 cache).
        num_heads, num_kv_heads: H and Hkv.

    Returns:
        fp32 [T, H + 2 * Hkv, D]: rotated q, rotated k, then v.
    """
    if not (_writable_cache(k_cache) and _writable_cache(v_cache)):
        k_cache = v_cache = None
    if _native(qkv) and qkv.dtype in (torch.float32, torch.bfloat16):
        out = torch.ops.llm_cpu.rotary_qkv(
            qkv.contiguous(), cos, sin, positions, slot_mapping, k_cache, v_cache,
            num_heads, num_kv_heads,
        )  # fmt: skip
        return cast(torch.Tensor, out)
    t = qkv.shape[0]
    heads = num_heads + 2 * num_kv_heads
    x = qkv.float().view(t, heads, -1)
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    nqk = num_heads + num_kv_heads
    x1, x2 = x[:, :nqk].chunk(2, dim=-1)
    out = torch.cat((torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1), x[:, nqk:]), dim=1)
    if k_cache is not None and v_cache is not None:
        d = out.shape[-1]
        k_cache.view(-1, num_kv_heads, d).index_copy_(
            0, slot_mapping, out[:, num_heads:nqk].to(k_cache.dtype)
        )
        v_cache.view(-1, num_kv_heads, d).index_copy_(
            0, slot_mapping, out[:, nqk:].to(v_cache.dtype)
        )
    return out


def decode_kernel_usable(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """True when ``paged_decode_attention`` runs the compiled kernel for these tensors."""
    return _native(q) and k_cache.dtype in (torch.float32, torch.bfloat16)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Decode attention read through block tables by the compiled kernel.

    Args:
        q: fp32 [B, H, D] (heads contiguous; rows may be strided).
        k_cache, v_cache: [num_blocks, block_size, Hkv, D] fp32 or bf16.
        block_tables: [B, max_blocks] int64; context_lens: [B] int64.
        out_dtype: dtype of the returned [B, H * D].
    """
    if q.stride(-1) != 1 or q.stride(1) != q.shape[2]:
        q = q.contiguous()
    out = torch.ops.llm_cpu.paged_decode_attention(
        q, k_cache, v_cache, block_tables, context_lens, q.shape[-1] ** -0.5, out_dtype
    )
    return cast(torch.Tensor, out)
