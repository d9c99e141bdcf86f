"""CPU tiers: what this CPU can run, and a cap on what the engine may use.

Tiers, highest first (each includes the ones below)::

    amx          AVX-512 with BF16 and AMX tiles (Sapphire Rapids and later)
    avx512_bf16  AVX-512 with AVX512-BF16 dot products, no AMX (Zen 4, Cooper Lake)
    avx512       AVX-512 F/BW/VL without BF16 (Skylake-SP, Ice Lake)
    avx2         AVX2 + FMA only
    default      none of the above (the kernels' scalar and SSE branches)

The cap (``engine_core.cpu_isa``) limits our own kernels: they are compiled with
``-march=native`` minus the instruction sets above the cap, so a machine with AMX
can run, and measure, the AVX-512-BF16 and AVX2 paths. Torch's own kernels are
capped by their own switches, which must be set before the process first runs
them: ``ATEN_CPU_CAPABILITY`` (ATen's vectorized ops) and ``ONEDNN_MAX_CPU_ISA``
(oneDNN's matmuls). ``apply_cap`` sets both where they are unset and
``torch_tier`` reads back what ATen really runs, so a half-capped process is
reported as such.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

TIERS = ("default", "avx2", "avx512", "avx512_bf16", "amx")  # lowest first
CAPS = ("native", "avx512_bf16", "avx512", "avx2")  # what engine_core.cpu_isa accepts
# /proc/cpuinfo flags a tier needs beyond the tier below it
_NEEDS = {
    "avx2": ("avx2", "fma"),
    "avx512": ("avx512f", "avx512bw", "avx512vl"),
    "avx512_bf16": ("avx512_bf16",),
    "amx": ("amx_tile", "amx_bf16"),
}
# gcc flags that take a tier's instruction sets away from -march=native
_NO_FLAGS = {
    "amx": ("-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"),
    "avx512_bf16": ("-mno-avx512bf16",),
    "avx512": ("-mno-avx512f",),  # turns off every AVX-512 extension with it
}
# the torch switches for a capped tier: (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA)
_TORCH_CAPS = {
    "avx512_bf16": ("avx512", "AVX512_CORE_BF16"),
    "avx512": ("avx512", "AVX512_CORE"),
    "avx2": ("avx2", "AVX2"),
}
CAP_ENV = "LLM_ENGINE_CORE_CPU_ISA"


def cpu_flags() -> frozenset[str]:
    """The ISA flags of /proc/cpuinfo (empty where there is none)."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.is_file():
        return frozenset()
    for line in cpuinfo.read_text().splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def tier_of(flags: frozenset[str] | set[str]) -> str:
    """The highest tier whose flags (and those of every tier below) are all present."""
    tier = "default"
    for t in TIERS[1:]:
        if not all(f in flags for f in _NEEDS[t]):
            break
        tier = t
    return tier


def capped(native: str, cap: str) -> str:
    """The tier run under ``cap`` on a CPU of tier ``native``.

    Raises:
        ValueError: an unknown cap.
    """
    if cap not in CAPS:
        raise ValueError(f"cpu_isa {cap!r}: use one of {', '.join(CAPS)}")
    if cap == "native":
        return native
    return TIERS[min(TIERS.index(native), TIERS.index(cap))]


def compile_flags(native: str, cap: str) -> list[str]:
    """The gcc flags (after ``-march=native``) that keep the kernels within ``cap``."""
    run = capped(native, cap)
    flags: list[str] = []
    for t in TIERS[TIERS.index(run) + 1 :]:
        flags += _NO_FLAGS.get(t, ())
    return flags if TIERS.index(run) < TIERS.index(native) else []


def requested_cap() -> str:
    """The cap the kernels build under: ``$LLM_ENGINE_CORE_CPU_ISA``, else ``native``
    (the engine sets it from ``engine_core.cpu_isa`` through ``apply_cap``)."""
    return os.environ.get(CAP_ENV, "native") or "native"


@cache
def native_tier() -> str:
    """This CPU's tier, from its flags."""
    return tier_of(cpu_flags())


def torch_tier() -> str:
    """ATen's vectorization tier as torch reports it (``AVX512``, ``AVX2``, ``DEFAULT``…)."""
    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except (AttributeError, RuntimeError):
        return "unknown"


@dataclass(frozen=True, slots=True)
class TierReport:
    """The tier this process runs, for logs and GetModelInfo.

    Attributes:
        native: the CPU's own tier.
        cap: ``engine_core.cpu_isa``.
        kernels: the tier our kernels were built for (``native`` capped by ``cap``
            when they loaded; ``none`` without them).
        aten: ATen's capability as torch reports it.
        onednn: ``ONEDNN_MAX_CPU_ISA`` (empty = oneDNN picks the CPU's best).
    """

    native: str
    cap: str
    kernels: str
    aten: str
    onednn: str

    @property
    def label(self) -> str:
        """``isa=avx2 (capped from avx512_bf16; aten AVX2, onednn AVX2)`` style."""
        how = f"cpu {self.native}" if self.kernels == self.native else f"capped, cpu {self.native}"
        onednn = self.onednn or "native"
        return f"isa={self.kernels} ({how}; aten {self.aten}, onednn {onednn})"


def cap_env(cap: str) -> dict[str, str]:
    """The environment that caps a process tree at ``cap`` on this CPU: our switch and,
    below the CPU's own tier, ATen's and oneDNN's (for any torch-based engine alike).

    Raises:
        ValueError: an unknown cap.
    """
    run = capped(native_tier(), cap)
    env = {CAP_ENV: cap}
    if run != native_tier() and run in _TORCH_CAPS:
        env["ATEN_CPU_CAPABILITY"], env["ONEDNN_MAX_CPU_ISA"] = _TORCH_CAPS[run]
    return env


def apply_cap(cap: str) -> None:
    """Cap the tier for this process: our kernels (built under the cap when first
    loaded) and, where not set already, ATen's and oneDNN's switches.

    Call before the kernels load (``cpu_kernels.ops_available``) and before torch's
    first vectorized op where possible: torch reads its switches once.

    Raises:
        ValueError: an unknown cap.
    """
    env = cap_env(cap)
    os.environ[CAP_ENV] = env.pop(CAP_ENV)
    for name, value in env.items():
        os.environ.setdefault(name, value)
    aten = env.get("ATEN_CPU_CAPABILITY", "")
    if aten == "avx2" and torch_tier().upper() == "AVX512":
        logger.warning(
            "cpu_isa %s: ATen already runs AVX512 (set ATEN_CPU_CAPABILITY=%s before "
            "start to cap torch alike)", cap, aten,
        )  # fmt: skip


def report(kernels: str) -> TierReport:
    """What this process runs: ``kernels`` is the tier our kernels were built for
    (``cpu_kernels.kernel_tier``; empty when they are not loaded)."""
    cap = requested_cap()
    onednn = os.environ.get("ONEDNN_MAX_CPU_ISA", "")
    return TierReport(native_tier(), cap, kernels or "none", torch_tier(), onednn)
