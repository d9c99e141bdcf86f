"""Lossless 4-bit (and 8-bit) storage for weights that are 4-bit (8-bit) per block already.

A checkpoint converted from a Q4_1 GGUF (the default model is one) holds, in
every block of 32 inputs of a projection row, only values ``d * q + m`` with
``q`` in 0..15 and ``d``, ``m`` fp16. Such a weight is stored again as those
nibbles and scales: 0.625 bytes per weight instead of bf16's 2, and a decode
step, which is bound by reading the weights, streams 3.2x fewer bytes.

``q4_pack`` recovers ``d``, ``m`` and ``q`` from the fp32 weight and keeps them
only when they reproduce every value exactly (``d * q + m`` in exact
arithmetic, rounded once to fp32, as the kernel's fused multiply-add does):
any other weight returns None and keeps its dense path, so this never changes
what a model computes beyond the bf16 rounding the dense path has anyway.

Packed layout (the tile order ``csrc/q4_linear.cpp`` reads), per 16 output
channels ``nb`` and 32 inputs ``kb``, 320 bytes::

    [  0..255]  16 rows kp x 16 bytes: byte i = lane i | lane (16 + i) << 4
                lane L of row kp = (channel 16 nb + L // 2, input 32 kb + 2 kp + L % 2)
    [256..287]  d of the 16 channels, fp16
    [288..319]  m of the 16 channels, fp16
"""

from __future__ import annotations

import torch

BLOCK = 32
TILE_BYTES = 320


def q4_shape_ok(n: int, k: int) -> bool:
    """True when an [n, k] weight fits the packed layout (whole 16 x 32 tiles)."""
    return n % 16 == 0 and k % BLOCK == 0 and n > 0 and k > 0


def q4_pack(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight [N, K] (fp32, exact values) packed as uint8 [N/16, K/32, 320], or
    None when it is not exactly 4-bit per 32-block with fp16 scale and minimum."""
    if weight.dim() != 2 or weight.dtype != torch.float32:
        return None
    n, k = weight.shape
    if not q4_shape_ok(n, k):
        return None
    blocks = weight.reshape(n, k // BLOCK, BLOCK).double()
    lo = blocks.amin(-1)
    d = ((blocks.amax(-1) - lo) / 15).to(torch.float16)
    m = lo.to(torch.float16)
    d64, m64 = d.double().unsqueeze(-1), m.double().unsqueeze(-1)
    safe_d = torch.where(d64 > 0, d64, torch.ones_like(d64))
    q = torch.where(d64 > 0, torch.round((blocks - m64) / safe_d), torch.zeros_like(blocks))
    q = q.clamp_(0, 15)
    if not torch.equal((d64 * q + m64).float(), blocks.float()):
        return None
    # [nb, n16, kb, kp, j] -> [nb, kb, kp, lane = n16 * 2 + j]
    lanes = q.to(torch.uint8).reshape(n // 16, 16, k // BLOCK, 16, 2)
    lanes = lanes.permute(0, 2, 3, 1, 4).reshape(n // 16, k // BLOCK, 16, 32)
    nibbles = (lanes[..., :16] | (lanes[..., 16:] << 4)).reshape(n // 16, k // BLOCK, 256)
    return torch.cat([nibbles, _per_tile(d), _per_tile(m)], dim=-1).contiguous()


def _per_tile(v: torch.Tensor) -> torch.Tensor:
    """Per-block fp16 values [N, K/32] as each tile's 16 channels: [N/16, K/32, 32] bytes."""
    n, kb = v.shape
    t = v.reshape(n // 16, 16, kb).permute(0, 2, 1).contiguous()
    return t.view(torch.uint8).reshape(n // 16, kb, 32)


def q4_unpack(packed: torch.Tensor) -> torch.Tensor:
    """The fp32 weight [N, K] a packing holds (the reference the kernels are tested on)."""
    nb, kb, _ = packed.shape
    nib = packed[..., :256].reshape(nb, kb, 16, 16)
    lanes = torch.cat([nib & 15, nib >> 4], dim=-1).float()  # [nb, kb, kp, 32 lanes]
    d = packed[..., 256:288].contiguous().view(torch.float16).float()  # [nb, kb, 16]
    m = packed[..., 288:320].contiguous().view(torch.float16).float()
    lanes = lanes.reshape(nb, kb, 16, 16, 2)  # [nb, kb, kp, n16, j]
    w = lanes * d[:, :, None, :, None] + m[:, :, None, :, None]
    return w.permute(0, 3, 1, 2, 4).reshape(nb * 16, kb * BLOCK)


# 8-bit: a tensor converted from a Q8_0 GGUF (the default model's tied embedding,
# so its LM head) holds in every block of 32 inputs only d * q with q in
# -127..127 and d fp16; that product is exact in fp32 (11 + 8 significant bits),
# so ``d * q`` in the kernel is the fp32 weight bit for bit. 1.0625 bytes per
# weight instead of fp32's 4. Packed layout per 16 output channels nb and 32
# inputs kb, 544 bytes (the fp32 panel order of ``csrc/q4_linear.cpp``)::
#
#     [  0..511]  byte 32 kp + 8 g + 2 c + j = q of channel 16 nb + 4 g + c,
#                 input 32 kb + 2 kp + j (int8)
#     [512..543]  d of the 16 channels, fp16

Q8_TILE_BYTES = 544


def q8_pack(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight [N, K] (fp32, exact values) packed as uint8 [N/16, K/32, 544], or
    None when it is not exactly ``d * q`` per 32-block with fp16 d and |q| <= 127."""
    if weight.dim() != 2 or weight.dtype != torch.float32:
        return None
    n, k = weight.shape
    if not q4_shape_ok(n, k):
        return None
    blocks = weight.reshape(n, k // BLOCK, BLOCK)
    d = (blocks.abs().amax(-1).double() / 127).to(torch.float16)  # the largest |q| is 127
    df = d.float().unsqueeze(-1)
    if not torch.isfinite(df).all():
        return None
    safe_d = torch.where(df > 0, df, torch.ones_like(df))
    q = torch.where(df > 0, torch.round(blocks / safe_d), torch.zeros_like(blocks))
    if q.abs().max() > 127 or not torch.equal(q * df, blocks):  # the product is exact
        return None
    # [nb, g, c, kb, kp, j] -> [nb, kb, kp, g, c, j]
    lanes = q.to(torch.int8).reshape(n // 16, 4, 4, k // BLOCK, 16, 2)
    lanes = lanes.permute(0, 3, 4, 1, 2, 5).reshape(n // 16, k // BLOCK, 512)
    return torch.cat([lanes.view(torch.uint8), _per_tile(d)], dim=-1).contiguous()


def q8_unpack(packed: torch.Tensor) -> torch.Tensor:
    """The fp32 weight [N, K] an 8-bit packing holds."""
    nb, kb, _ = packed.shape
    q = packed[..., :512].contiguous().view(torch.int8).float()
    d = packed[..., 512:].contiguous().view(torch.float16).float()  # [nb, kb, 16]
    q = q.reshape(nb, kb, 16, 4, 4, 2)  # [nb, kb, kp, g, c, j]
    w = q * d.reshape(nb, kb, 1, 4, 4, 1)
    return w.permute(0, 3, 4, 1, 2, 5).reshape(nb * 16, kb * BLOCK)
