"""Attention over the paged cache with a sliding window and/or softcapped scores.

The compiled kernels and SDPA attend a token's whole causal context with plain
scores. Layers that need more run here: a sliding window (Mistral, Gemma 2/3's
local layers, Qwen with ``use_sliding_window``), only once some context of the
step is longer than the window (shorter ones are the same with or without it),
and Gemma 2's ``cap * tanh(s / cap)`` scores, always. One explicit score matrix
per decode batch and per prefill chunk, masked by position; K and V are already
in the cache (``ops.rotary_qkv`` wrote them). q comes scaled so that
``head_dim ** -0.5`` is the right softmax scale (the loader folds any other
query scale into the weights), as for the kernels.
"""

from __future__ import annotations

import torch

from engine_svc.models.attention import AttentionMetadata, _gather


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """q [B, H, n, D] against k, v [B, Hkv, L, D]; positions q_pos [B, n], k_pos [L].

    Returns [B, H, n, D] in fp32."""
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.matmul(q.float(), k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    allowed = k_pos[None, None, :] <= q_pos[:, :, None]
    if window is not None:
        allowed &= k_pos[None, None, :] > q_pos[:, :, None] - window
    scores.masked_fill_(~allowed[:, None], -torch.inf)
    return torch.matmul(torch.softmax(scores, dim=-1), v)


def windowed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    positions: torch.Tensor,
    meta: AttentionMetadata,
    window: int | None,
    softcap: float | None,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Attend the step's queries within ``window`` keys, scores capped at ``softcap``.

    Args:
        q: [T, H, D] rotated queries; k, v: [T, Hkv, D] the step's own keys and
            values (read for fresh prompts; everything else comes from the cache).
        k_cache, v_cache: [num_blocks, block_size, Hkv, D], this step's K/V written.
        positions: [T] absolute positions of the step's tokens.
        meta: the step's metadata.
        window: keys with position > query position - window; None = whole context.
        softcap: None, or the cap of ``cap * tanh(score / cap)``.
        kv_scales: per-head (k, v) scales [Hkv] of an FP8 cache.
        out_dtype: dtype of the result; default q's.

    Returns:
        [T, H * D] attention output.
    """
    num_heads, head_dim = q.shape[1], q.shape[2]
    nd = meta.num_decode_tokens
    parts: list[torch.Tensor] = []
    if nd:
        assert meta.decode_blocks is not None
        kd, vd = _gather(k_cache, v_cache, meta.decode_blocks, kv_scales)
        k_pos = torch.arange(kd.shape[2], device=q.device)
        out = _attend(q[:nd, :, None], kd, vd, positions[:nd, None], k_pos, window, softcap)
        parts.append(out.reshape(nd, num_heads * head_dim))
    for seg in meta.prefill_segments:
        rows = slice(nd + seg.start, nd + seg.start + seg.length)
        q_pos = positions[rows]
        if seg.blocks is None:  # a fresh prompt: its own K and V, positions from 0
            kp, vp = k[rows].transpose(0, 1)[None], v[rows].transpose(0, 1)[None]
            k_pos = q_pos
        else:
            kp, vp = _gather(k_cache, v_cache, seg.blocks, kv_scales)
            k_pos = torch.arange(kp.shape[2], device=q.device)
        qs = q[rows].transpose(0, 1)[None]
        out = _attend(qs, kp, vp, q_pos[None], k_pos, window, softcap)
        parts.append(out[0].transpose(0, 1).reshape(seg.length, num_heads * head_dim))
    result = parts[0] if len(parts) == 1 else torch.cat(parts)
    return result.to(out_dtype or q.dtype)
