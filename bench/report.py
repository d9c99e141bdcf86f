"""Where and how every benchmark writes its report: bench/reports/<name>.json (+ .png)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common.config import ROOT

REPORT_DIR = ROOT / "bench" / "reports"


def save_report(name: str, report: dict[str, Any],
                chart: Callable[[Path], None] | None = None) -> Path:
    """Write ``<name>.json`` (and ``<name>.png`` through ``chart``); return the JSON path."""
    REPORT_DIR.mkdir(parents=True, exist_ok=True)
    path = REPORT_DIR / f"{name}.json"
    path.write_text(json.dumps(report, indent=2, default=str))
    if chart is not None:
        chart(REPORT_DIR / f"{name}.png")
    print(f"report: {path}" + (" (+ .png)" if chart is not None else ""))
    return path
