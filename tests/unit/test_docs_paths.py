"""The README and docs/ name only paths that exist, and the README stays a short reference."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import yaml

from common.config import ROOT

README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
CONFIGURATION = ROOT / "docs" / "configuration.md"
MAX_README_LINES = 150

FENCE = re.compile(r"^```.*?^```", re.M | re.S)
SPAN = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"\]\(([^)\s]+)\)")
# a repository path: segments of word characters, dots and dashes joined by slashes,
# the first segment a plain name (not `llm.v1.Gateway/Generate`, `/v1/models`, a URL)
PATH = re.compile(r"[a-z_][\w-]*(/[\w.-]+)+/?")
DOTTED = re.compile(r"(?:python -m )?([a-z_]+(?:\.[a-z_0-9]+)+)")
MODULE = re.compile(r"[a-z_][\w]*\.py")
# made at set-up or run time, not tracked: `make protos`, `make run`, `make model`, `make bench`
GENERATED = ("llm/", "build/", "bench/reports/")
# path-shaped names that are not paths
NOT_PATHS = frozenset({"http/1.1"})


def prose(page: Path) -> str:
    """The page without its fenced code blocks (commands and output, not references)."""
    return FENCE.sub("", page.read_text())


def named_paths(page: Path) -> set[str]:
    """Repository paths a page names in backticks, relative to the repository root."""
    found = set()
    for span in SPAN.findall(prose(page)):
        if span in NOT_PATHS or span.startswith(GENERATED):
            continue
        if "/" in span and PATH.fullmatch(span):
            found.add(span.rstrip("/"))
    return found


def named_modules(page: Path) -> set[str]:
    """Bare Python file names a page names in backticks (``scheduler.py``)."""
    return {span for span in SPAN.findall(prose(page)) if MODULE.fullmatch(span)}


def named_modules_dotted(page: Path) -> set[str]:
    """Dotted names in backticks whose first part is a package of the repository
    (``bench.gateway_bench``, ``python -m common.redis_cluster``, ``gateway.workers``)."""
    found = set()
    for span in SPAN.findall(prose(page)):
        m = DOTTED.fullmatch(span)
        package = m.group(1).split(".")[0] if m else ""
        if m and package != "llm" and (ROOT / package / "__init__.py").exists():
            found.add(m.group(1))
    return found


def names_something(dotted: str, config: dict[str, object]) -> bool:
    """Its second part is a module or subpackage of its package, or a key of the config
    section the package shares its name with (``gateway.workers``, ``ratelimit.fail_mode``),
    or the whole name is one the package's code spells out (a span name: ``gateway.auth``)."""
    package, name = dotted.split(".")[:2]
    if (ROOT / package / f"{name}.py").exists() or (ROOT / package / name).is_dir():
        return True
    section = config.get(package)
    if isinstance(section, dict) and name in section:
        return True
    return any(dotted in p.read_text() for p in (ROOT / package).rglob("*.py"))


def repository_file_names() -> set[str]:
    """The name of every file in the working tree, outside hidden and cache folders."""
    names: set[str] = set()
    for _folder, subfolders, files in os.walk(ROOT):
        subfolders[:] = [d for d in subfolders if not d.startswith((".", "__pycache__"))]
        names.update(files)
    return names


def linked_paths(page: Path) -> set[Path]:
    """Local link targets of a page, resolved against the page's folder."""
    targets = set()
    for target in LINK.findall(page.read_text()):
        if "://" in target or target.startswith(("#", "mailto:")):
            continue
        targets.add((page.parent / target.split("#", 1)[0]).resolve())
    return targets


def layout_entries() -> list[str]:
    """The first column of the README's Layout block."""
    section = README.read_text().split("## Layout", 1)[1]
    block = section.split("```", 2)[1]
    entries = [line.split()[0] for line in block.splitlines() if line and not line[0].isspace()]
    return [e for e in entries if not e.startswith(GENERATED)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_path_a_page_names_exists(page: Path) -> None:
    missing = sorted(p for p in named_paths(page) if not (ROOT / p).exists())
    assert not missing, f"{page.relative_to(ROOT)} names paths that do not exist: {missing}"


def test_every_python_file_named_alone_exists_somewhere() -> None:
    names = repository_file_names()
    missing = sorted(
        f"{page.relative_to(ROOT)}: {m}" for page in PAGES for m in named_modules(page) - names
    )
    assert not missing, f"Python files named in the docs that exist nowhere: {missing}"


def test_every_module_named_by_its_dotted_name_exists() -> None:
    config = yaml.safe_load((ROOT / "config" / "stack.yaml").read_text())
    missing = sorted(
        f"{page.relative_to(ROOT)}: {name}"
        for page in PAGES
        if page != CONFIGURATION  # generated from the config classes, old flat keys included
        for name in named_modules_dotted(page)
        if not names_something(name, config)
    )
    assert not missing, f"modules named in the docs that do not exist: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_local_link_resolves(page: Path) -> None:
    missing = sorted(str(t) for t in linked_paths(page) if not t.exists())
    assert not missing, f"{page.relative_to(ROOT)} links to what does not exist: {missing}"


def test_the_readme_layout_names_existing_folders() -> None:
    entries = layout_entries()
    assert len(entries) >= 10  # the block was found
    missing = [e for e in entries if not (ROOT / e).exists()]
    assert not missing, f"README.md's Layout names what does not exist: {missing}"


def test_the_readme_is_a_short_reference() -> None:
    lines = README.read_text().count("\n")
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines; move detail to docs/"


def test_the_checks_catch_what_they_are_for(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "See `gateway/fleet/breakers.py`, `llm.v1.Gateway/Generate`, `/v1/models`, `http/1.1`,\n"
        "`.run/demo.key`, `llm/v1/`, `scheduler.py`, [a](other.md#x), [b](https://x.org/a),\n"
        "`python -m bench.capacity`, `ratelimit.redis_acl`, `grpc.health.v1`, `engine.backend`.\n"
        "```\ncommon/not_in_prose.py\n```\n"
    )
    assert named_paths(page) == {"gateway/fleet/breakers.py"}
    assert named_modules(page) == {"scheduler.py"}
    assert named_modules_dotted(page) == {"bench.capacity", "ratelimit.redis_acl"}
    assert not names_something("ratelimit.redis_acl", {"ratelimit": {"fail_mode": "open"}})
    assert names_something("ratelimit.fail_mode", {"ratelimit": {"fail_mode": "open"}})
    assert linked_paths(page) == {tmp_path / "other.md"}
