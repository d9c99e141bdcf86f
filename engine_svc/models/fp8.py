"""FP8 (e4m3) weights with one scale per output channel, and the linear op over them.

Storage is 1 byte per weight plus 4 per output row: half of bf16, a quarter of
fp32. The linear op picks a path by device and batch:

- CUDA with compute capability >= 8.9: ``torch._scaled_mm`` (fp8 tensor cores),
  activations quantized per row on the fly.
- CPU, few rows (decode): a compiled op (``llm_cpu::fp8_gemv``) that decodes
  e4m3 in registers inside the GEMV, so each weight byte is read once and never
  expanded in memory.
- CPU, many rows (prefill) or no compiler: dequantize this weight alone into
  one reused bf16 buffer (compiled op, or torch's cast) and run a bf16 matmul;
  the buffer holds the largest single weight, never the model.

The per-channel scale is applied to the output: ``x @ (q * s)^T = (x @ q^T) * s``.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from engine_svc.models import cpu_kernels

logger = logging.getLogger(__name__)

FP8_MAX = 448.0
GEMV_MAX_ROWS = 8


class Fp8Weight:
    """An [N, K] weight as float8_e4m3fn plus an fp32 scale per output row.

    Args:
        weight: the full-precision weight [N, K].
    """

    __slots__ = ("qweight", "scale")

    def __init__(self, weight: torch.Tensor) -> None:
        w = weight.float()
        amax = w.abs().amax(dim=1).clamp(min=1e-12)
        self.scale = (amax / FP8_MAX).contiguous()
        q = (w / self.scale[:, None]).clamp(-FP8_MAX, FP8_MAX)
        self.qweight = q.to(torch.float8_e4m3fn).contiguous()

    @property
    def shape(self) -> torch.Size:
        """[N, K], like the weight it replaces."""
        return self.qweight.shape

    @property
    def nbytes(self) -> int:
        """Bytes held (fp8 weight + scales)."""
        return self.qweight.numel() + self.scale.numel() * 4

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight back in ``dtype`` (for tests and references)."""
        return (self.qweight.float() * self.scale[:, None]).to(dtype)


def _native(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and cpu_kernels.ops_available()


_buffers: dict[torch.device, torch.Tensor] = {}


def _scratch(numel: int, device: torch.device) -> torch.Tensor:
    buf = _buffers.get(device)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(numel, dtype=torch.bfloat16, device=device)
        _buffers[device] = buf
    return buf[:numel]


def _dequant_bf16(w: Fp8Weight) -> torch.Tensor:
    n, k = w.shape
    out = _scratch(n * k, w.qweight.device).view(n, k)
    if _native(w.qweight):
        torch.ops.llm_cpu.fp8_dequant_bf16(w.qweight.view(torch.uint8), out)
    else:
        out.copy_(w.qweight)
    return out


def _cuda_scaled_mm_ok(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def _scaled_mm(x2: torch.Tensor, w: Fp8Weight, out_dtype: torch.dtype) -> torch.Tensor:
    x_scale = (x2.abs().amax(dim=1, keepdim=True).float() / FP8_MAX).clamp(min=1e-12)
    xq = (x2.float() / x_scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return torch._scaled_mm(
        xq, w.qweight.t(), scale_a=x_scale, scale_b=w.scale[None, :], out_dtype=out_dtype
    )


def fp8_linear(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, w, bias)`` for an FP8 weight; the result is in ``x.dtype``."""
    n, k = w.shape
    x2 = x.reshape(-1, k)
    rows = x2.shape[0]
    y: torch.Tensor | None = None
    if _cuda_scaled_mm_ok(x.device):
        try:
            y = _scaled_mm(x2, w, torch.bfloat16).to(x.dtype)
        except RuntimeError:
            y = None  # shape or build without fp8 GEMM support: dequantize instead
    if y is None:
        if _native(x) and rows <= GEMV_MAX_ROWS:
            xf = x2.float().contiguous()
            acc = torch.ops.llm_cpu.fp8_gemv(xf, w.qweight.view(torch.uint8))
            y = (acc * w.scale).to(x.dtype)
        else:
            y = (F.linear(x2.to(torch.bfloat16), _dequant_bf16(w)).float() * w.scale).to(x.dtype)
    if bias is not None:
        y = y + bias
    return y.view(*x.shape[:-1], n)


def linear(
    x: torch.Tensor, w: torch.Tensor | Fp8Weight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear`` that also accepts an ``Fp8Weight``."""
    if isinstance(w, Fp8Weight):
        return fp8_linear(x, w, bias)
    return F.linear(x, w, bias)
