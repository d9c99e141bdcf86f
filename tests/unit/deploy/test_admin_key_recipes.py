"""The admin-key recipes in deploy/ produce keys the gateway's format check accepts."""

from __future__ import annotations

import re
import secrets
from pathlib import Path

import pytest

from ratelimit.tenancy.records import looks_like_key

DEPLOY = Path(__file__).resolve().parents[3] / "deploy"
# ADMIN_KEY=sk-llm-$(openssl rand -hex 24) / admin-key="sk-llm-$(openssl rand -hex 24)"
RECIPE = re.compile(r"(?:ADMIN_KEY|admin-key)=[\"']?(\S*?)\$\(openssl rand -hex (\d+)\)")


@pytest.mark.parametrize("path", ["compose.yaml", "k8s/secret.yaml"])
def test_documented_admin_key_generator_passes_the_format_check(path: str) -> None:
    text = (DEPLOY / path).read_text()
    recipes = RECIPE.findall(text)
    assert recipes, f"no `openssl rand` recipe in {path}"
    for prefix, nbytes in recipes:
        key = prefix + secrets.token_hex(int(nbytes))
        assert looks_like_key(key), f"{path}: {prefix}$(openssl rand -hex {nbytes}) -> {key!r}"
