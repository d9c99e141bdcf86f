"""Paged attention: KV written through a slot mapping, read through block tables.

Flat token layout of one step (decodes first, then prefill chunks)::

    tokens:  | d0 | d1 | d2 | p0 p0 p0 p0 | p1 p1 |
             '-- decodes --''---- prefill chunks ----'
    slot_mapping[t] = block_table[pos // block_size] * block_size + pos % block_size

Reads gather whole blocks (``index_select`` on the block dimension, ~2x faster
than per-slot gathers), and decode folds grouped-query heads into the query
length: q [B, Hkv, G, D] against k [B, Hkv, L, D], which beats SDPA's own
GQA path on CPU. Everything index-shaped (block lists, masks) is built once
per step in ``build_attention_metadata`` and reused by every layer, so a layer
costs one ``index_copy_`` per cache, one gather and one SDPA call per group.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn.functional as F

from engine_svc.models import kv_fp8, ops, timing


@dataclass(slots=True)
class PrefillSegment:
    """One sequence's prefill chunk within the step's prefill rows.

    Attributes:
        start: first row of the chunk among the step's prefill tokens.
        length: tokens in the chunk.
        blocks: [1, nblk] block table covering cached + new tokens, or None
            for a fresh prompt (no cached prefix: plain causal attention over
            the chunk's own K/V, nothing read from the cache).
        mask: [1, 1, length, nblk * block_size] bool, causal-with-offset over
            the cached context and the chunk (None when fresh).
    """

    start: int
    length: int
    blocks: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    _additive: torch.Tensor | None = None

    def additive_mask(self, dtype: torch.dtype) -> torch.Tensor:
        """The mask as 0 / -inf in ``dtype`` (SDPA's CPU kernel takes it ~15% faster
        than a bool mask), built once per step and shared by every layer."""
        assert self.mask is not None
        if self._additive is None or self._additive.dtype != dtype:
            blank = torch.zeros(self.mask.shape, dtype=dtype, device=self.mask.device)
            self._additive = blank.masked_fill_(~self.mask, -torch.inf)
        return self._additive


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step indices shared by all layers.

    Attributes:
        slot_mapping: [T] cache slot of each new token.
        num_decode_tokens: the first ``num_decode_tokens`` rows are decodes (q_len 1).
        decode_blocks: [Bd, nblk] block table of each decode (0 = padding).
        decode_context_lens: [Bd] tokens each decode attends to.
        prefill_segments: the prefill sequences of the step, each attended on
            its own (no padding to the longest, no cross-sequence mask).
        prefill_dtype: dtype of prefill attention math (None = the inputs'); bf16
            where the CPU has bf16 matrix units (``choose_prefill_dtype``).
        prefill_kernel: run prefill attention in the fused kernel
            (``ops.prefill_attention``: AMX tiles, or AVX512-BF16 dot products),
            which reads the context through the block tables, when the cache and
            shapes allow it
            (``choose_prefill_kernel``).
        prefill_seqs: [S, 3] int64 (first row, length, cached tokens) of each
            prefill segment, for the fused kernel.
        prefill_tables: [S, W] int64 block tables of the prefill segments.
    """

    slot_mapping: torch.Tensor
    num_decode_tokens: int
    decode_blocks: torch.Tensor | None = None
    decode_context_lens: torch.Tensor | None = None
    prefill_segments: list[PrefillSegment] = field(default_factory=list)
    prefill_dtype: torch.dtype | None = None
    prefill_kernel: bool = False
    prefill_seqs: torch.Tensor | None = None
    prefill_tables: torch.Tensor | None = None


def _pad(rows: Sequence[Sequence[int]], width: int) -> list[list[int]]:
    return [list(r) + [0] * (width - len(r)) for r in rows]


def build_attention_metadata(
    num_computed: Sequence[int],
    num_new: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    num_decodes: int,
    block_size: int,
    device: torch.device,
) -> tuple[AttentionMetadata, torch.Tensor]:
    """Build the step's metadata and the positions [T] of its tokens.

    Args:
        num_computed: tokens already in the cache, per sequence.
        num_new: tokens scheduled this step, per sequence (1 for the first
            ``num_decodes`` sequences).
        block_tables: block ids per sequence, covering computed + new tokens.
        num_decodes: how many leading sequences are decodes.
        block_size: tokens per block.
        device: where the tensors go.
    """
    if num_decodes == len(num_new):
        return _decode_only_metadata(num_computed, block_tables, block_size, device)
    width = max(len(b) for b in block_tables)
    bt = torch.tensor(_pad(block_tables, width), dtype=torch.long, device=device)
    computed = torch.tensor(num_computed, dtype=torch.long, device=device)
    new = torch.tensor(num_new, dtype=torch.long, device=device)
    seq_idx = torch.repeat_interleave(torch.arange(len(num_new), device=device), new)
    starts = torch.cumsum(new, 0) - new
    positions = computed[seq_idx] + torch.arange(int(new.sum()), device=device) - starts[seq_idx]
    slots = bt[seq_idx, positions // block_size] * block_size + positions % block_size
    meta = AttentionMetadata(slot_mapping=slots, num_decode_tokens=num_decodes)
    if num_decodes:
        ctx = computed[:num_decodes] + 1
        nblk = -(-int(ctx.max()) // block_size)
        meta.decode_blocks = bt[:num_decodes, :nblk].contiguous()
        meta.decode_context_lens = ctx
    if len(num_new) > num_decodes:
        _prefill_metadata(
            meta, num_computed[num_decodes:], num_new[num_decodes:], bt[num_decodes:], block_size
        )
    return meta, positions


def _decode_only_metadata(
    num_computed: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    device: torch.device,
) -> tuple[AttentionMetadata, torch.Tensor]:
    """The common step (every sequence decodes one token), built from Python lists:
    three tensor constructions instead of a dozen small tensor ops."""
    ctx = [c + 1 for c in num_computed]
    nblk = -(-max(ctx) // block_size)
    slots = [
        bt[c // block_size] * block_size + c % block_size
        for c, bt in zip(num_computed, block_tables, strict=True)
    ]
    tables = _pad([bt[:nblk] for bt in block_tables], nblk)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        num_decode_tokens=len(ctx),
        decode_blocks=torch.tensor(tables, dtype=torch.long, device=device),
        decode_context_lens=torch.tensor(ctx, dtype=torch.long, device=device),
    )
    return meta, torch.tensor(list(num_computed), dtype=torch.long, device=device)


def _prefill_metadata(
    meta: AttentionMetadata,
    computed: Sequence[int],
    q_lens: Sequence[int],
    bt: torch.Tensor,
    block_size: int,
) -> None:
    row = 0
    seqs: list[tuple[int, int, int]] = []
    for i, (c, n) in enumerate(zip(computed, q_lens, strict=True)):
        seg = PrefillSegment(row, n)
        seqs.append((row, n, c))
        row += n
        if c:
            kv_len = c + n
            nblk = -(-kv_len // block_size)
            seg.blocks = bt[i : i + 1, :nblk]
            q_pos = torch.arange(c, kv_len, device=bt.device)
            j = torch.arange(nblk * block_size, device=bt.device)
            seg.mask = (j[None, :] <= q_pos[:, None])[None, None]
        meta.prefill_segments.append(seg)
    meta.prefill_seqs = torch.tensor(seqs, dtype=torch.long, device=bt.device)
    meta.prefill_tables = bt.contiguous()


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    cache_written: bool = False,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Write this step's K/V into the cache (unless already written) and attend.

    Args:
        q: [T, H, D]; k, v: [T, Hkv, D], all in the attention dtype.
        k_cache, v_cache: [num_blocks, block_size, Hkv, D], one layer's cache
            (fp32, bf16, or float8_e4m3fn with ``kv_scales``).
        meta: the step's metadata.
        kv_scales: per-head K and V scales [Hkv] of an FP8 cache.
        cache_written: k and v are already in the cache (``ops.rotary_qkv``).
        out_dtype: dtype of the result; default the attention dtype.

    Returns:
        [T, H * D] attention output.
    """
    _, num_kv_heads, head_dim = k.shape
    out_dtype = out_dtype or q.dtype
    if cache_written:
        pass
    elif kv_scales is not None:
        kv_fp8.write_kv(k_cache, meta.slot_mapping, k, kv_scales[0])
        kv_fp8.write_kv(v_cache, meta.slot_mapping, v, kv_scales[1])
    else:
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(
            0, meta.slot_mapping, k.to(k_cache.dtype)
        )
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(
            0, meta.slot_mapping, v.to(v_cache.dtype)
        )
    num_tokens = q.shape[0]
    nd = meta.num_decode_tokens
    parts: list[torch.Tensor] = []
    if nd:
        parts.append(_decode_attention(q[:nd], k_cache, v_cache, meta, kv_scales, out_dtype))
    if num_tokens > nd:
        pre = _prefill_attention(q[nd:], k[nd:], v[nd:], k_cache, v_cache, meta, kv_scales)
        parts.append(pre.to(out_dtype))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    nd, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    assert meta.decode_blocks is not None
    if ops.decode_kernel_usable(q, k_cache):
        assert meta.decode_context_lens is not None
        return ops.paged_decode_attention(
            q.float(), k_cache, v_cache, meta.decode_blocks, meta.decode_context_lens,
            out_dtype, kv_scales,
        )  # fmt: skip
    assert meta.decode_context_lens is not None
    kd, vd = _gather(k_cache, v_cache, meta.decode_blocks, kv_scales)
    qd = q.reshape(nd, num_kv_heads, num_heads // num_kv_heads, head_dim)
    kd, vd = kd.to(q.dtype), vd.to(q.dtype)
    keys = torch.arange(kd.shape[2], device=q.device)
    mask = (keys < meta.decode_context_lens[:, None])[:, None, None, :]
    out = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask)
    return out.reshape(nd, num_heads * head_dim).to(out_dtype)


def _prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    num_tokens, num_heads, head_dim = q.shape
    # the engine chose the kernel at start for this cache (choose_prefill_kernel): no
    # dispatcher call per layer here, only what a step could change
    kernel = meta.prefill_kernel and kv_scales is None
    if kernel and k_cache.dtype in ops.prefill_kernel_caches():
        assert meta.prefill_seqs is not None
        assert meta.prefill_tables is not None
        return ops.prefill_attention(q, k_cache, v_cache, meta.prefill_seqs, meta.prefill_tables)
    if meta.prefill_dtype is not None and meta.prefill_dtype != q.dtype:
        q, k, v = q.to(meta.prefill_dtype), k.to(meta.prefill_dtype), v.to(meta.prefill_dtype)
    outs = [
        _attend_segment(q, k, v, k_cache, v_cache, seg, kv_scales) for seg in meta.prefill_segments
    ]
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out.reshape(num_tokens, num_heads * head_dim)


def _attend_segment(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seg: PrefillSegment,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None,
) -> torch.Tensor:
    """[length, H, D] attention of one sequence's chunk. 4-D inputs throughout:
    with 3-D ones SDPA falls back to its slow math kernel on CPU."""
    rows = slice(seg.start, seg.start + seg.length)
    qs = q[rows].transpose(0, 1).unsqueeze(0)
    if seg.blocks is None:
        out = F.scaled_dot_product_attention(
            qs, k[rows].transpose(0, 1).unsqueeze(0), v[rows].transpose(0, 1).unsqueeze(0),
            is_causal=True, enable_gqa=True,
        )  # fmt: skip
    else:
        kp, vp = _gather(k_cache, v_cache, seg.blocks, kv_scales)
        out = F.scaled_dot_product_attention(
            qs, kp.to(q.dtype), vp.to(q.dtype), attn_mask=seg.additive_mask(q.dtype),
            enable_gqa=True,
        )  # fmt: skip
    return out[0].transpose(0, 1)


def choose_prefill_dtype(
    num_heads: int, num_kv_heads: int, head_dim: int, candidates: tuple[torch.dtype, ...]
) -> tuple[torch.dtype, dict[str, float]]:
    """The faster dtype for causal prefill attention on this CPU, by timing SDPA.

    With AMX or AVX512-BF16, bf16 flash attention runs 2-3x faster than fp32
    for prompt-sized shapes; without them it is several times slower. The
    candidates run in interleaved rounds, best of each (``timing.compare_ms``),
    so a busy machine does not flip the choice.

    Returns:
        the dtype and the measured ms per candidate (one 512-token prompt).
    """
    g = torch.Generator().manual_seed(0)
    q32 = torch.randn(1, num_heads, 512, head_dim, generator=g)
    kv32 = torch.randn(1, num_kv_heads, 512, head_dim, generator=g)
    by_name = {str(dt).removeprefix("torch."): dt for dt in candidates}
    runs = {name: partial(_causal_sdpa, q32.to(dt), kv32.to(dt)) for name, dt in by_name.items()}
    timings = timing.compare_ms(runs, rounds=15)
    return by_name[min(timings, key=lambda n: timings[n])], timings


def choose_prefill_kernel(
    num_heads: int, num_kv_heads: int, head_dim: int, attn_dtype: torch.dtype,
    kv_dtype: torch.dtype, block_size: int,
) -> tuple[bool, dict[str, float]]:  # fmt: skip
    """Whether the fused prefill kernel beats SDPA here, by timing both.

    Both attend one 512-token prompt stored in a paged cache of ``kv_dtype``:
    SDPA in ``attn_dtype`` (the prompt's own K/V, the engine's fresh-prompt
    path) against the kernel reading the cache through a block table. The
    kernel (``ops.prefill_kernel_dtype``) is bf16 on AVX512-BF16 (AMX where
    present) over a bf16 cache, else fp32 on AVX2 over a bf16 or fp32 cache, with
    block sizes in multiples of 16; where it cannot run the answer is False with
    no timing.

    Returns:
        True to use the kernel, and the measured ms per candidate.
    """
    q_dtype = ops.prefill_kernel_dtype()
    probe_q = torch.empty(1, num_heads, head_dim, dtype=q_dtype or torch.bfloat16)
    probe_cache = torch.empty(1, block_size, num_kv_heads, head_dim, dtype=kv_dtype)
    if q_dtype is None or not ops.prefill_kernel_usable(probe_q, probe_cache, None):
        return False, {}
    g = torch.Generator().manual_seed(0)
    n = 512
    nblk = -(-n // block_size)
    q = torch.randn(n, num_heads, head_dim, generator=g).to(q_dtype)
    k = torch.randn(nblk * block_size, num_kv_heads, head_dim, generator=g).to(kv_dtype)
    v = torch.randn(nblk * block_size, num_kv_heads, head_dim, generator=g).to(kv_dtype)
    k_cache = k.view(nblk, block_size, num_kv_heads, head_dim)
    v_cache = v.view(nblk, block_size, num_kv_heads, head_dim)
    seqs = torch.tensor([[0, n, 0]], dtype=torch.long)
    tables = torch.arange(nblk, dtype=torch.long)[None]
    q4 = q.transpose(0, 1)[None].to(attn_dtype)
    k4 = k[:n].transpose(0, 1)[None].to(attn_dtype)
    v4 = v[:n].transpose(0, 1)[None].to(attn_dtype)
    runs = {
        "fused": partial(ops.prefill_attention, q, k_cache, v_cache, seqs, tables),
        "sdpa": partial(
            F.scaled_dot_product_attention, q4, k4, v4, is_causal=True, enable_gqa=True
        ),
    }
    timings = timing.compare_ms(runs, rounds=15)
    return timings["fused"] < timings["sdpa"], timings


def _causal_sdpa(q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True)


def _gather(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    blocks: torch.Tensor,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Contexts [B, Hkv, nblk * block_size, D] of K and V for block tables [B, nblk]."""
    if kv_scales is not None:
        return (
            kv_fp8.gather_kv(k_cache, blocks, kv_scales[0]),
            kv_fp8.gather_kv(v_cache, blocks, kv_scales[1]),
        )
    b, nblk = blocks.shape
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    flat = blocks.reshape(-1)
    shape = (b, nblk * block_size, num_kv_heads, head_dim)
    k = k_cache.index_select(0, flat).view(shape).transpose(1, 2)
    v = v_cache.index_select(0, flat).view(shape).transpose(1, 2)
    return k, v
