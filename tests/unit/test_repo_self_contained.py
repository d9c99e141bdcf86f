"""The repository stands alone: nothing in it points at planning material outside it."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from common.config import ROOT

# written in pieces so this file does not match itself
FORBIDDEN = re.compile(
    "|".join(
        [
            r"\.\./" + "shared",
            "PERF" + "-NOTES",
            "DESIGN" + r"\.md",
            "DESIGN" + " §",
            r"\b" + "issues?" + r" #?\d+",
            r"\b" + "item" + r" \d+\b",
        ]
    ),
    re.IGNORECASE,
)


def tracked_text_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
    paths = [ROOT / p for p in out.stdout.decode().split("\0") if p]
    return [p for p in paths if p.is_file() and b"\0" not in p.read_bytes()[:4096]]


def test_no_file_refers_to_material_outside_the_repository() -> None:
    files = tracked_text_files()
    assert len(files) > 100  # the listing worked
    hits = [
        f"{p.relative_to(ROOT)}:{i}: {line.strip()[:100]}"
        for p in files
        for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
        if FORBIDDEN.search(line)
    ]
    assert not hits, "references to material outside the repository:\n" + "\n".join(hits)


def test_the_pattern_catches_what_it_is_for() -> None:
    for text in (
        "see ../" + "shared/notes",
        "as in issue" + " 14",
        "DESIGN" + ".md says",
        "(item" + " 4)",
    ):
        assert FORBIDDEN.search(text), text
    assert not FORBIDDEN.search("a known issue with the tokenizer; items in a list")
