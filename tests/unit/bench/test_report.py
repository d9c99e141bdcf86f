"""Every benchmark report records the machine it ran on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import report


def test_save_report_records_cpu_flags_threads_and_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(report, "REPORT_DIR", tmp_path)
    path = report.save_report("x", {"figure": 1.0, "machine": {"loadavg": [9.0, 9.0, 9.0]}})
    saved = json.loads(path.read_text())
    m = saved["machine"]
    assert saved["figure"] == 1.0
    assert set(m["isa"]) == set(report.ISA_FLAGS)
    assert all(isinstance(v, bool) for v in m["isa"].values())
    assert m["cores"] >= 1
    assert len(m["loadavg_at_save"]) == 3
    assert m["cpu"]
    assert m["loadavg"] == [9.0, 9.0, 9.0]  # the bench's own reading is kept
    assert "torch_threads" in m
