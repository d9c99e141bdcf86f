"""Linear layers prepared for this CPU, and the start-up choice of weight dtype.

A ``Linear`` holds one projection weight [N, K] in the form the fastest
matmul of this machine wants: on CPU a oneDNN-prepacked weight (reordered
once at load, so no call pays the reorder; ~2x faster than ``F.linear`` for
decode-sized batches), elsewhere the plain tensor.

Which weight dtype is fastest depends on the CPU, not on habit: with AMX or
AVX512-BF16 a bf16 GEMM is several times faster than fp32, on an AVX2-only
CPU it is 4-6x slower. ``choose_cpu_linear`` times the model's own MLP shapes
at decode and prefill batch sizes for each candidate and keeps the fastest.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import cast

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

CANDIDATE_DTYPES = (torch.float32, torch.bfloat16)
BENCH_ROWS = (1, 16, 64, 256)


def mkldnn_packing_available() -> bool:
    """True when this torch build can prepack linear weights for oneDNN."""
    return bool(torch.backends.mkldnn.is_available()) and hasattr(  # type: ignore[no-untyped-call]
        torch.ops.mkldnn, "_linear_pointwise"
    )


class Linear:
    """``y = x @ W^T (+ b)`` over a weight prepared once.

    Args:
        weight: [N, K] in the compute dtype.
        bias: optional [N].
        packed: prepack for oneDNN (CPU only); the dense weight is dropped.
    """

    __slots__ = ("bias", "packed", "shape", "weight")

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None, packed: bool = False
    ) -> None:
        self.shape = weight.shape
        self.bias = bias
        self.packed = packed and weight.device.type == "cpu"
        if self.packed:
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 32)
        else:
            self.weight = weight

    @property
    def dtype(self) -> torch.dtype:
        """The weight's dtype."""
        return cast(torch.dtype, self.weight.dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.packed:
            return F.linear(x, self.weight, self.bias)
        x2 = x.reshape(-1, self.shape[1])
        y = cast(
            torch.Tensor,
            torch.ops.mkldnn._linear_pointwise(x2, self.weight, self.bias, "none", [], ""),
        )
        return y if x.dim() == 2 else y.view(*x.shape[:-1], self.shape[0])


@dataclass(slots=True)
class LinearChoice:
    """The weight dtype and matmul form the engine runs with, and why.

    Attributes:
        dtype: weight / activation dtype of the decoder.
        packed: oneDNN-prepacked weights.
        reason: ``benchmark``, ``forced`` or ``device``.
        timings_ms: candidate -> median ms per row count (empty unless measured).
    """

    dtype: torch.dtype
    packed: bool
    reason: str
    timings_ms: dict[str, dict[int, float]] = field(default_factory=dict)

    @property
    def name(self) -> str:
        """``bfloat16+packed`` style label for logs and model info."""
        return str(self.dtype).removeprefix("torch.") + ("+packed" if self.packed else "")


def _median_ms(fn: object, reps: int) -> float:
    call = fn  # type: ignore[assignment]
    for _ in range(2):
        call()  # type: ignore[operator]
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        call()  # type: ignore[operator]
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2] * 1e3


def _time_candidate(
    dtype: torch.dtype, packed: bool, hidden: int, intermediate: int
) -> dict[int, float]:
    g = torch.Generator().manual_seed(0)
    up = Linear(torch.randn(2 * intermediate, hidden, generator=g).to(dtype), packed=packed)
    down = Linear(torch.randn(hidden, intermediate, generator=g).to(dtype), packed=packed)
    out = {}
    for rows in BENCH_ROWS:
        x = torch.randn(rows, hidden, generator=g).to(dtype)
        h = torch.randn(rows, intermediate, generator=g).to(dtype)
        reps = 15 if rows <= 64 else 5
        out[rows] = _median_ms(lambda x=x, h=h: (up(x), down(h)), reps)
    return out


def choose_cpu_linear(
    hidden: int, intermediate: int, dtype: torch.dtype | None = None
) -> LinearChoice:
    """Pick weight dtype and packing for this CPU by timing the model's MLP shapes.

    Every candidate is scored by the geometric mean of its time over decode
    and prefill row counts (``BENCH_ROWS``), so neither single-stream latency
    nor batched throughput is sacrificed to the other.

    Args:
        hidden, intermediate: the model's sizes.
        dtype: a dtype the config forces; only packing is then chosen.
    """
    dtypes = (dtype,) if dtype is not None else CANDIDATE_DTYPES
    packings = (False, True) if mkldnn_packing_available() else (False,)
    timings: dict[str, dict[int, float]] = {}
    best: tuple[float, torch.dtype, bool] | None = None
    with torch.inference_mode():
        for dt in dtypes:
            for packed in packings:
                try:
                    t = _time_candidate(dt, packed, hidden, intermediate)
                except RuntimeError as exc:  # a build without this kernel
                    logger.info("linear candidate %s packed=%s unusable: %s", dt, packed, exc)
                    continue
                label = str(dt).removeprefix("torch.") + ("+packed" if packed else "")
                timings[label] = t
                score = math.exp(sum(math.log(v) for v in t.values()) / len(t))
                if best is None or score < best[0]:
                    best = (score, dt, packed)
    assert best is not None, "float32 F.linear always works"
    choice = LinearChoice(best[1], best[2], "benchmark" if dtype is None else "forced", timings)
    logger.info("linear layers: %s (ms per MLP pair by rows: %s)", choice.name, timings)
    return choice
