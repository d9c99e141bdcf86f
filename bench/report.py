"""Where and how every benchmark writes its report: bench/reports/<name>.json (+ .png)."""

from __future__ import annotations

import json
import os
import platform
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common.config import ROOT

REPORT_DIR = ROOT / "bench" / "reports"
ISA_FLAGS = (
    "avx2",
    "fma",
    "avx512f",
    "avx512_bf16",
    "avx512_vnni",
    "avx_vnni",
    "amx_bf16",
    "amx_int8",
    "amx_tile",
)


def machine_facts() -> dict[str, Any]:
    """CPU model, the ISA flags that decide kernels, cores and load."""
    model, flags = platform.processor(), set()
    info = Path("/proc/cpuinfo")
    if info.is_file():
        for line in info.read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    return {
        "cpu": model,
        "isa": {f: f in flags for f in ISA_FLAGS},
        "cores": os.cpu_count(),
        # torch's pool where this process loaded torch; the servers' own pools are in
        # their GetModelInfo.compute
        "torch_threads": sys.modules["torch"].get_num_threads() if "torch" in sys.modules else None,
        "loadavg": os.getloadavg(),
    }


def stamp_machine(report: dict[str, Any]) -> dict[str, Any]:
    """Set ``report["machine"]`` (see ``save_report``); returns the report."""
    report["machine"] = {
        **machine_facts(),
        "loadavg_at_save": os.getloadavg(),
        **report.get("machine", {}),
    }
    return report


def save_report(
    name: str, report: dict[str, Any], chart: Callable[[Path], None] | None = None
) -> Path:
    """Write ``<name>.json`` (and ``<name>.png`` through ``chart``); return the JSON path.

    Every report gets ``machine``: the CPU model, the ISA flags that decide kernels,
    cores, torch threads and the load average when it is written (keys the bench set
    itself, such as a load average taken before it ran, are kept)."""
    stamp_machine(report)
    path = REPORT_DIR / f"{name}.json"  # a name with folders (or absolute) works too
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=str))
    if chart is not None:
        chart(REPORT_DIR / f"{name}.png")
    print(f"report: {path}" + (" (+ .png)" if chart is not None else ""))
    return path
