"""The house rules a newcomer relies on, checked on every run.

- No tracked source file passes 500 lines (generated code is not tracked): past that a
  module holds more than one role and is split.
- Every module of the gateway's request and fleet layers has a unit test file of its own,
  at the mirrored path (``gateway/request/admission.py`` ->
  ``tests/unit/gateway/request/test_admission.py``).

The import layers are checked by ``make lint`` (lint-imports, ``[tool.importlinter]``).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from common.config import ROOT

MAX_LINES = 500
SOURCE_SUFFIXES = {".py", ".cpp", ".cc", ".h", ".hpp"}
TESTED_PACKAGES = ("gateway/request", "gateway/fleet")


def tracked_sources() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
    paths = [ROOT / p for p in out.stdout.decode().split("\0") if p]
    return [p for p in paths if p.suffix in SOURCE_SUFFIXES and p.is_file()]


def test_no_source_file_is_over_500_lines() -> None:
    sources = tracked_sources()
    assert len(sources) > 200  # the listing worked
    counts = {
        str(p.relative_to(ROOT)): len(p.read_text(errors="replace").splitlines()) for p in sources
    }
    long = {path: n for path, n in counts.items() if n > MAX_LINES}
    assert not long, f"split these by role (each over {MAX_LINES} lines): {long}"


@pytest.mark.parametrize("package", TESTED_PACKAGES)
def test_every_module_has_a_unit_test_file(package: str) -> None:
    modules = sorted(p for p in (ROOT / package).glob("*.py") if p.name != "__init__.py")
    assert modules, f"no modules found under {package}"
    tests = ROOT / "tests" / "unit" / package
    missing = [
        f"{p.relative_to(ROOT)} -> {(tests / f'test_{p.name}').relative_to(ROOT)}"
        for p in modules
        if not (tests / f"test_{p.name}").is_file()
    ]
    assert not missing, f"modules without a unit test file: {missing}"
