"""Rotary position embeddings (RoPE) with HF ``rope_scaling`` variants."""

from __future__ import annotations

import math
from typing import Any

import torch

# "dynamic" is plain RoPE up to the original length, where the config caps the context
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "dynamic")


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling.get("original_max_position_embeddings", 8192))
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in fp32, after any rope scaling.

    Raises:
        ValueError: a ``rope_type`` this engine does not implement.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if rope_type == "default":
        return inv_freq
    raise ValueError(
        f"rope_type {rope_type!r} is not supported; supported: {list(SUPPORTED_ROPE_TYPES)}"
    )


class RotaryEmbedding:
    """Precomputed cos/sin tables; ``lookup`` once per step, ``apply`` per layer.

    Layout is HF's non-interleaved "rotate half": the first and second halves of
    each head are the real and imaginary parts.
    """

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        theta: float,
        scaling: dict[str, Any] | None,
        device: torch.device,
    ) -> None:
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        pos = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(pos, inv_freq)
        self.cos = freqs.cos().to(device)
        self.sin = freqs.sin().to(device)
        self.max_position = max_position

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows for ``positions`` shaped [T, 1, head_dim // 2]."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` [T, heads, head_dim] by the looked-up angles (same dtype as cos)."""
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
