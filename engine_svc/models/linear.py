"""Linear layers prepared for this CPU: weight dtype and matmul path chosen by measurement.

A ``Linear`` keeps its weight [N, K] dense and picks a path per call by the
number of rows:

    rows <= skinny_max_rows   ops.skinny_linear: streams the weight once with
                              the rows in L1 (decode is bound by reading weights)
    otherwise                 a weight prepacked at load (``packed``): our AMX
                              tile kernel (``amx``) or oneDNN's (``onednn``);
                              or F.linear

Which dtype and which paths are fastest depends on the CPU, not on habit: with
AMX or AVX512-BF16 a bf16 GEMM is several times faster than fp32, on an
AVX2-only CPU it is 4-6x slower; a prepacked oneDNN weight is 2x faster on some
machines and buys nothing on others; where the CPU has AMX, our tile kernel
(the weight streamed once in tile order) is ~2x faster than oneDNN's at decode
and prefill row counts on the machines measured. ``choose_cpu_dtype`` times the model's
MLP shapes for each dtype before the weights are loaded; ``tune_linears`` then
times the loaded model's own projections (weights streamed from memory, as in
serving) at decode and prefill row counts and sets the thresholds.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import cast

import torch
import torch.nn.functional as F

from engine_svc.models import ops

logger = logging.getLogger(__name__)

CANDIDATE_DTYPES = (torch.float32, torch.bfloat16)
DTYPE_BENCH_ROWS = (1, 16, 64, 256)
SKINNY_ROWS = (1, 2, 4, 8, 16, 32)
LARGE_ROWS = (16, 64, 256)
PACKING_MIN_GAIN = 1.10  # a packed copy costs memory: take it only when clearly faster
PACKINGS = ("amx", "onednn")


def mkldnn_packing_available() -> bool:
    """True when this torch build can prepack linear weights for oneDNN."""
    return bool(torch.backends.mkldnn.is_available()) and hasattr(  # type: ignore[no-untyped-call]
        torch.ops.mkldnn, "_linear_pointwise"
    )


class Linear:
    """``y = x @ W^T (+ b)`` with a path chosen by row count (see the module doc).

    Args:
        weight: [N, K] in the compute dtype.
        bias: optional [N].
    """

    __slots__ = ("bias", "packed", "packing", "shape", "skinny_max_rows", "weight")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.shape = weight.shape
        self.weight = weight.contiguous()
        self.bias = bias
        self.packed: torch.Tensor | None = None
        self.packing = ""  # "amx" | "onednn" while packed
        self.skinny_max_rows = 0

    @property
    def dtype(self) -> torch.dtype:
        """The weight's dtype."""
        return self.weight.dtype

    def can_pack(self, packing: str) -> bool:
        """True when ``pack(packing)`` applies to this weight on this machine."""
        if self.weight.device.type != "cpu":
            return False
        if packing == "amx":
            return ops.amx_available(self.weight)
        return packing == "onednn" and mkldnn_packing_available()

    def pack(self, packing: str = "onednn") -> None:
        """Add a prepacked copy (``amx`` tile order or ``onednn``'s) used above
        ``skinny_max_rows``; a weight the packing does not apply to stays dense."""
        if self.packing == packing or not self.can_pack(packing):
            return
        if packing == "amx":
            self.packed = torch.ops.llm_cpu.amx_pack(self.weight)
        else:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, 32)
        self.packing = packing

    def unpack(self) -> None:
        """Drop the prepacked copy."""
        self.packed = None
        self.packing = ""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.shape[1])
        if x2.shape[0] <= self.skinny_max_rows and self.bias is None:
            y = ops.skinny_linear(x2, self.weight)
        elif self.packing == "amx":
            y = cast(torch.Tensor, torch.ops.llm_cpu.amx_linear(x2.contiguous(), self.packed))
            if self.bias is not None:
                y = y + self.bias
        elif self.packed is not None:
            y = cast(
                torch.Tensor,
                torch.ops.mkldnn._linear_pointwise(x2, self.packed, self.bias, "none", [], ""),
            )
        else:
            y = F.linear(x2, self.weight, self.bias)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], self.shape[0])


@dataclass(slots=True)
class LinearChoice:
    """The weight dtype and matmul paths the engine runs with, and why.

    Attributes:
        dtype: weight / activation dtype of the decoder.
        reason: ``benchmark``, ``forced``, ``device`` or ``fp8``.
        packed: prepacked copies above the skinny threshold.
        packing: which (``amx`` or ``onednn``; empty when not packed).
        skinny_max_rows: rows up to which the streaming kernel runs.
        timings_ms: what was measured (candidate -> rows -> median ms).
    """

    dtype: torch.dtype
    reason: str
    packed: bool = False
    packing: str = ""
    skinny_max_rows: int = 0
    timings_ms: dict[str, dict[int, float]] = field(default_factory=dict)

    @property
    def name(self) -> str:
        """``bfloat16+skinny<=4+packed`` style label for logs and model info."""
        label = str(self.dtype).removeprefix("torch.")
        if self.skinny_max_rows:
            label += f"+skinny<={self.skinny_max_rows}"
        if self.packed:
            label += "+amx" if self.packing == "amx" else "+packed"
        return label


def _median_ms(fn: Callable[[], object], reps: int) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2] * 1e3


def _geomean(values: Sequence[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def _mlp_pair(x: torch.Tensor, h: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> None:
    F.linear(x, up)
    F.linear(h, down)


def choose_cpu_dtype(hidden: int, intermediate: int) -> LinearChoice:
    """Pick the weight dtype for this CPU by timing the model's MLP shapes with F.linear.

    Each dtype is scored by the geometric mean of its time over decode and
    prefill row counts, so neither single-stream latency nor batched
    throughput is sacrificed to the other.
    """
    g = torch.Generator().manual_seed(0)
    timings: dict[str, dict[int, float]] = {}
    best: tuple[float, torch.dtype] | None = None
    with torch.inference_mode():
        for dt in CANDIDATE_DTYPES:
            up = torch.randn(2 * intermediate, hidden, generator=g).to(dt)
            down = torch.randn(hidden, intermediate, generator=g).to(dt)
            t: dict[int, float] = {}
            for rows in DTYPE_BENCH_ROWS:
                x = torch.randn(rows, hidden, generator=g).to(dt)
                h = torch.randn(rows, intermediate, generator=g).to(dt)
                reps = 15 if rows <= 64 else 5
                t[rows] = _median_ms(partial(_mlp_pair, x, h, up, down), reps)
            timings[str(dt).removeprefix("torch.")] = t
            score = _geomean(list(t.values()))
            if best is None or score < best[0]:
                best = (score, dt)
    assert best is not None
    return LinearChoice(best[1], "benchmark", timings_ms=timings)


def _sweep(linears: Sequence[Linear], rows: Sequence[int], reps: int = 3) -> dict[int, float]:
    """Median ms to run every linear once at each row count (weights streamed)."""
    g = torch.Generator().manual_seed(0)
    out = {}
    for m in rows:
        xs = {
            k: torch.randn(m, k, generator=g).to(linears[0].dtype)
            for k in {lin.shape[1] for lin in linears}
        }

        def run(xs: dict[int, torch.Tensor] = xs) -> None:
            for lin in linears:
                lin(xs[lin.shape[1]])

        out[m] = _median_ms(run, reps)
    return out


def _choose_packing(linears: Sequence[Linear], choice: LinearChoice) -> dict[str, dict[int, float]]:
    """Time the large-row path dense and under each packing; keep the fastest packing
    when it beats dense by PACKING_MIN_GAIN. Returns the timings."""
    large = {"dense": _sweep(linears, LARGE_ROWS)}
    for packing in PACKINGS:
        if not any(lin.can_pack(packing) for lin in linears):
            continue
        for lin in linears:
            lin.unpack()
            lin.pack(packing)
        large[packing] = _sweep(linears, LARGE_ROWS)
    for lin in linears:
        lin.unpack()
    cost = {k: _geomean(list(v.values())) for k, v in large.items()}
    best = min(cost, key=lambda k: cost[k])
    choice.packed = best != "dense" and cost["dense"] / cost[best] >= PACKING_MIN_GAIN
    choice.packing = best if choice.packed else ""
    for lin in linears if choice.packed else ():
        lin.pack(best)
    return large


def tune_linears(linears: Sequence[Linear], choice: LinearChoice) -> LinearChoice:
    """Set the skinny threshold and packing of ``linears`` by timing them as loaded.

    Args:
        linears: the model's projections (all of them: the sweep streams the
            weights from memory the way a decode step does).
        choice: the dtype choice; filled in and returned.
    """
    if not linears or linears[0].weight.device.type != "cpu":
        return choice
    with torch.inference_mode():
        for lin in linears:
            lin.skinny_max_rows = 0
        large = _choose_packing(linears, choice)
        base = _sweep(linears, SKINNY_ROWS)
        skinny: dict[int, float] = {}
        if ops.skinny_available(linears[0].weight):
            for lin in linears:
                lin.skinny_max_rows = max(SKINNY_ROWS)
            skinny = _sweep(linears, SKINNY_ROWS)
        threshold = 0
        for m in SKINNY_ROWS:  # the largest row count below which skinny always wins
            if m not in skinny or skinny[m] >= base[m]:
                break
            threshold = m
        for lin in linears:
            lin.skinny_max_rows = threshold
    choice.skinny_max_rows = threshold
    choice.timings_ms.update({f"{k}-streamed": v for k, v in large.items()})
    choice.timings_ms["large-path-streamed"] = base
    choice.timings_ms["skinny-streamed"] = skinny
    logger.info("linear layers: %s (measured ms: %s)", choice.name, choice.timings_ms)
    return choice
