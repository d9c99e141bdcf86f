"""FP8 (e4m3) KV cache: quantized writes, dequantizing reads, scale calibration.

The cache tensors are ``float8_e4m3fn`` (1 byte per value: a quarter of fp32,
half of bf16) and every (layer, KV head) has one K scale and one V scale::

    stored = clamp(k / k_scale[head], -448, 448).to(e4m3)
    k      = stored.float() * k_scale[head]

Scales come from a calibration pass at start-up (amax per layer and head over
a fixed token sequence, times a headroom factor) and then stay fixed, so a
value written early never needs rescaling. e4m3 is a float format: the
headroom costs no precision, only range at the very small end. Copies and
gathers go through a uint8 view because torch has few kernels for fp8 dtypes;
attention math stays fp32.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0
HEADROOM = 4.0


def write_kv(
    cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, scale: torch.Tensor
) -> None:
    """Quantize ``x`` [T, Hkv, D] with per-head ``scale`` [Hkv] into ``cache`` at ``slots``."""
    _, num_kv_heads, head_dim = x.shape
    q = (x.float() / scale[None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    flat = cache.view(torch.uint8).view(-1, num_kv_heads, head_dim)
    flat.index_copy_(0, slots, q.view(torch.uint8))


def gather_kv(cache: torch.Tensor, blocks: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Dequantized fp32 contexts [B, Hkv, nblk * block_size, D] for block tables [B, nblk]."""
    b, nblk = blocks.shape
    _, block_size, num_kv_heads, head_dim = cache.shape
    raw = cache.view(torch.uint8).index_select(0, blocks.reshape(-1))
    x = raw.view(torch.float8_e4m3fn).float().view(b, nblk * block_size, num_kv_heads, head_dim)
    return (x * scale[None, None, :, None]).transpose(1, 2)


def scales_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """Scales [..., Hkv] mapping ``HEADROOM * amax`` to the e4m3 maximum."""
    return (amax.float() * HEADROOM / FP8_MAX).clamp(min=1e-6)


def calibration_token_ids(vocab_size: int, num_tokens: int = 128) -> list[int]:
    """A fixed pseudo-random token sequence (same on every start)."""
    g = torch.Generator().manual_seed(1234)
    return torch.randint(0, vocab_size, (num_tokens,), generator=g).tolist()
