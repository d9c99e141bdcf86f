"""Linear layers prepared for this CPU: weight dtype and matmul path chosen by measurement.

A ``Linear`` keeps its weight [N, K] dense and picks a path per call by the
number of rows:

    rows <= skinny_max_rows   a weight-streaming GEMV (decode is bound by
                              reading weights): ops.q4_linear on the weight's
                              4-bit copy where it has one (exactly 4-bit per
                              block, see ``q4.py``: 3.2x fewer bytes than bf16),
                              ops.q8_linear on its 8-bit copy (exactly Q8_0,
                              fp32 weights), else ops.skinny_linear on the
                              dense weight
    otherwise                 a weight prepacked at load (``packed``): our AMX
                              tile kernel (``amx``) or oneDNN's (``onednn``);
                              or F.linear

Which dtype and which paths are fastest depends on the CPU, not on habit: with
AMX or AVX512-BF16 a bf16 GEMM is several times faster than fp32, on an
AVX2-only CPU it is 4-6x slower; a prepacked oneDNN weight is 2x faster on some
machines and buys nothing on others; where the CPU has AMX, our tile kernel
(the weight streamed once in tile order) is ~2x faster than oneDNN's at decode
and prefill row counts on the machines measured. ``path_choice`` times a small
copy of the model per dtype, on the batches the engine will run, before the
weights are loaded; ``tune_linears`` then times the loaded model's own
projections (weights streamed from memory, as in serving) at decode and prefill
row counts and sets the thresholds.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import cast

import torch
import torch.nn.functional as F

from engine_svc.models import ops, timing

logger = logging.getLogger(__name__)

SKINNY_ROWS = (1, 2, 4, 8, 16, 32)
LARGE_ROWS = (16, 64, 256)
PACKING_MIN_GAIN = 1.10  # a packed copy costs memory: take it only when clearly faster
PACKINGS = ("onednn", "amx")  # a weight one does not apply to keeps the one before


def mkldnn_packing_available(dtype: torch.dtype = torch.float32) -> bool:
    """True when this torch build, on this CPU (as capped by ``ONEDNN_MAX_CPU_ISA``), can
    prepack linear weights of ``dtype`` for oneDNN (bf16 needs AVX512-BW/VL/DQ or
    AVX-NE-CONVERT; without them the reorder raises)."""
    if not (
        torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    ):
        return False
    return _onednn_packs(dtype)


@functools.cache
def _onednn_packs(dtype: torch.dtype) -> bool:
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(32, 32, dtype=dtype), 32)
    except RuntimeError:
        return False
    return True


class Linear:
    """``y = x @ W^T (+ b)`` with a path chosen by row count (see the module doc).

    Args:
        weight: [N, K] in the compute dtype.
        bias: optional [N].
    """

    __slots__ = ("bias", "packed", "packing", "q4", "q8", "shape", "skinny_max_rows", "weight")

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        q4: torch.Tensor | None = None,
        q8: torch.Tensor | None = None,
    ) -> None:
        self.shape = weight.shape
        self.weight = weight.contiguous()
        self.bias = bias
        # the weight 4-bit packed (``q4.q4_pack``), kept only where the 4-bit GEMV runs
        usable = q4 is not None and bias is None and ops.q4_applies(weight.dtype, weight.device)
        self.q4 = q4 if usable else None
        # the weight 8-bit packed (``q4.q8_pack``), where no 4-bit copy runs
        usable = q8 is not None and self.q4 is None and bias is None
        self.q8 = q8 if usable and ops.q8_applies(weight.dtype, weight.device) else None
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
        return packing == "onednn" and mkldnn_packing_available(self.weight.dtype)

    def packed_copy(self, packing: str) -> torch.Tensor | None:
        """The weight in ``packing``'s layout (``amx`` tile order or ``onednn``'s), or
        None where that packing does not apply to this weight on this machine."""
        if not self.can_pack(packing):
            return None
        if packing == "amx":
            return cast(torch.Tensor, torch.ops.llm_cpu.amx_pack(self.weight))
        return cast(torch.Tensor, torch.ops.mkldnn._reorder_linear_weight(self.weight, 32))

    def use_packed(self, packing: str, packed: torch.Tensor | None) -> None:
        """Run above ``skinny_max_rows`` on ``packed`` (from ``packed_copy(packing)``);
        None (or an empty ``packing``) means the dense weight."""
        self.packed = packed if packing else None
        self.packing = packing if packed is not None else ""

    def pack(self, packing: str = "onednn") -> None:
        """Add a prepacked copy used above ``skinny_max_rows``; a weight the packing
        does not apply to stays dense."""
        if self.packing != packing and (packed := self.packed_copy(packing)) is not None:
            self.use_packed(packing, packed)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.shape[1])
        if x2.shape[0] <= self.skinny_max_rows and self.bias is None:
            if self.q4 is not None:
                y = ops.q4_linear(x2, self.q4)
            elif self.q8 is not None:
                y = ops.q8_linear(x2, self.q8)
            else:
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
        skinny_max_rows: rows up to which the streaming kernel runs (projections
            without a 4- or 8-bit copy).
        q4_max_rows: rows up to which the 4-bit GEMV runs (projections with one).
        q8_max_rows: rows up to which the 8-bit kernel runs (projections with one:
            an LM head from a Q8_0 embedding, fp32 weights).
        timings_ms: what was measured (candidate -> rows -> median ms).
        detail: why this dtype, in words (the measured candidates), for logs and model info.
    """

    dtype: torch.dtype
    reason: str
    packed: bool = False
    packing: str = ""
    skinny_max_rows: int = 0
    q4_max_rows: int = 0
    q8_max_rows: int = 0
    timings_ms: dict[str, dict[int, float]] = field(default_factory=dict)
    detail: str = ""

    @property
    def name(self) -> str:
        """``bfloat16+skinny<=4+packed`` style label for logs and model info."""
        label = str(self.dtype).removeprefix("torch.")
        if self.q4_max_rows:
            label += f"+q4<={self.q4_max_rows}"
        if self.q8_max_rows:
            label += f"+q8<={self.q8_max_rows}"
        if self.skinny_max_rows:
            label += f"+skinny<={self.skinny_max_rows}"
        if self.packed:
            label += "+amx" if self.packing == "amx" else "+packed"
        return label


def _geomean(values: Sequence[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def _run_all(linears: Sequence[Linear], xs: dict[int, torch.Tensor]) -> None:
    for lin in linears:
        lin(xs[lin.shape[1]])


def _inputs(linears: Sequence[Linear], rows: int, g: torch.Generator) -> dict[int, torch.Tensor]:
    return {
        k: torch.randn(rows, k, generator=g).to(linears[0].dtype)
        for k in {lin.shape[1] for lin in linears}
    }


def _sweep(
    linears: Sequence[Linear],
    rows: Sequence[int],
    configs: Sequence[str],
    apply: timing.Prepare,
    rounds: int = 5,
) -> dict[str, dict[int, float]]:
    """ms to run every linear once (weights streamed, as in serving) at each row
    count, under each configuration; ``apply(config)`` switches the linears to it.
    Configurations are compared in interleaved rounds (``timing.compare_ms``)."""
    g = torch.Generator().manual_seed(0)
    out: dict[str, dict[int, float]] = {c: {} for c in configs}
    for m in rows:
        work = partial(_run_all, linears, _inputs(linears, m, g))
        for c, ms in timing.compare_ms(dict.fromkeys(configs, work), rounds, 1, apply).items():
            out[c][m] = ms
    return out


def _choose_packing(
    linears: Sequence[Linear], choice: LinearChoice, rounds: int
) -> dict[str, dict[int, float]]:
    """Time the large-row path dense and under each packing; keep the fastest packing
    when it beats dense by PACKING_MIN_GAIN. Returns the timings.

    A linear a packing does not apply to keeps the previous packing's copy."""
    dense: list[tuple[str, torch.Tensor | None]] = [("", None)] * len(linears)
    copies = {"dense": dense}
    for packing in PACKINGS:
        if any(lin.can_pack(packing) for lin in linears):
            prev = list(copies.values())[-1]
            copies[packing] = [
                (packing, t) if (t := lin.packed_copy(packing)) is not None else fallback
                for lin, fallback in zip(linears, prev, strict=True)
            ]

    def apply(config: str) -> None:
        for lin, (packing, packed) in zip(linears, copies[config], strict=True):
            lin.use_packed(packing, packed)

    large = _sweep(linears, LARGE_ROWS, list(copies), apply, rounds)
    cost = {k: _geomean(list(v.values())) for k, v in large.items()}
    best = min(cost, key=lambda k: cost[k])
    choice.packed = best != "dense" and cost["dense"] / cost[best] >= PACKING_MIN_GAIN
    choice.packing = best if choice.packed else ""
    apply(best if choice.packed else "dense")
    return large


def _small_row_threshold(
    linears: Sequence[Linear], rounds: int
) -> tuple[int, dict[str, dict[int, float]]]:
    """The largest row count up to which the few-row path (4-bit or dense GEMV) beats
    the large-row path at every row count of SKINNY_ROWS, and the timings."""
    configs = ["large"]
    if ops.skinny_available(linears[0].weight):
        configs.append("small")

    def apply(config: str) -> None:
        for lin in linears:
            lin.skinny_max_rows = max(SKINNY_ROWS) if config == "small" else 0

    timings = _sweep(linears, SKINNY_ROWS, configs, apply, rounds)
    base, small = timings["large"], timings.get("small", {})
    threshold = 0
    for m in SKINNY_ROWS:
        if m not in small or small[m] >= base[m]:
            break
        threshold = m
    for lin in linears:
        lin.skinny_max_rows = threshold
    return threshold, timings


# the few-row paths, each with its own threshold field in LinearChoice (``<path>_max_rows``)
FEW_ROW_PATHS = ("q4", "q8", "skinny")


def _few_row_path(lin: Linear) -> str:
    """Which few-row path ``lin`` takes: its 4-bit copy, its 8-bit copy, or the dense
    skinny GEMV (the order ``Linear.__call__`` tries them in)."""
    if lin.q4 is not None:
        return "q4"
    return "q8" if lin.q8 is not None else "skinny"


def _few_rows(lin: Linear, choice: LinearChoice) -> int:
    """The choice's few-row threshold for ``lin``'s path."""
    return int(getattr(choice, f"{_few_row_path(lin)}_max_rows"))


def apply_choice(linears: Sequence[Linear], choice: LinearChoice) -> None:
    """Set the thresholds and packing of ``linears`` as ``choice`` says, without timing
    (a choice ``tune_linears`` made before on this machine, kept by ``compute_cache``).

    A linear the chosen packing does not apply to keeps the packing before it in
    ``PACKINGS`` where that one applies, as ``tune_linears`` leaves it."""
    order = PACKINGS[: PACKINGS.index(choice.packing) + 1] if choice.packing else ()
    with torch.inference_mode():
        for lin in linears:
            packing, packed = "", None
            for p in order:
                if (t := lin.packed_copy(p)) is not None:
                    packing, packed = p, t
            lin.use_packed(packing, packed)
            lin.skinny_max_rows = _few_rows(lin, choice)


def tune_linears(
    linears: Sequence[Linear], choice: LinearChoice, rounds: int = 5, log: bool = True
) -> LinearChoice:
    """Set the few-row thresholds and packing of ``linears`` by timing them as loaded.

    The projections with a 4-bit copy, those with an 8-bit copy (an LM head
    from a Q8_0 embedding, fp32 weights) and the others get a threshold each:
    the low-bit kernels stream several times fewer bytes than the dense one, so
    they keep winning to more rows.

    Args:
        linears: the model's projections (all of them: the sweep streams the
            weights from memory the way a decode step does).
        choice: the dtype choice; filled in and returned.
        rounds: timed rounds per configuration and row count (best of them counts).
        log: log the outcome (off for the start-up dtype candidates).
    """
    if not linears or linears[0].weight.device.type != "cpu":
        return choice
    with torch.inference_mode():
        for lin in linears:
            lin.skinny_max_rows = 0
        large = _choose_packing(linears, choice, rounds)
        for path in FEW_ROW_PATHS:
            group = [lin for lin in linears if _few_row_path(lin) == path]
            if group:
                rows, times = _small_row_threshold(group, rounds)
                setattr(choice, f"{path}_max_rows", rows)
                choice.timings_ms[f"{path}-group-large-streamed"] = times["large"]
                choice.timings_ms[f"{path}-group-{path}-streamed"] = times.get("small", {})
    choice.timings_ms.update({f"{k}-streamed": v for k, v in large.items()})
    if log:
        logger.info("linear layers: %s (measured ms: %s)", choice.name, choice.timings_ms)
    return choice
