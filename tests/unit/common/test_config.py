"""Config loading: defaults < YAML < env < overrides, with clear errors."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from common.config import ServiceConfig, load_config


@dataclasses.dataclass(slots=True)
class DemoConfig(ServiceConfig):
    port: int = 1234
    ratio: float = 0.5
    enabled: bool = False
    names: list[str] = dataclasses.field(default_factory=list)
    budget: int | None = None


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "stack.yaml"
    p.write_text(text)
    return p


def test_precedence(tmp_path: Path) -> None:
    p = write(tmp_path, "demo:\n  port: 2000\n  ratio: 0.25\n  names: [a, b]\n")
    cfg = load_config(
        DemoConfig,
        "demo",
        path=p,
        env={"LLM_DEMO_RATIO": "0.75"},
        overrides={"enabled": True, "port": None},
    )
    assert (cfg.port, cfg.ratio, cfg.enabled, cfg.names) == (2000, 0.75, True, ["a", "b"])
    assert cfg.host == "127.0.0.1"  # inherited default


def test_env_coercion(tmp_path: Path) -> None:
    env = {
        "LLM_DEMO_ENABLED": "yes",
        "LLM_DEMO_NAMES": "x, y",
        "LLM_DEMO_BUDGET": "none",
        "LLM_DEMO_PORT": "9",
    }
    cfg = load_config(DemoConfig, "demo", path=write(tmp_path, "{}\n"), env=env)
    assert (cfg.enabled, cfg.names, cfg.budget, cfg.port) == (True, ["x", "y"], None, 9)


def test_missing_section_gives_defaults(tmp_path: Path) -> None:
    cfg = load_config(DemoConfig, "demo", path=write(tmp_path, "other: {}\n"), env={})
    assert cfg == DemoConfig()


@pytest.mark.parametrize(
    ("yaml_text", "env", "match"),
    [
        ("demo:\n  prot: 1\n", {}, r"unknown key\(s\) \['prot'\]"),
        ("demo:\n  port: eighty\n", {}, r"\[demo\] port: expected int, got 'eighty'"),
        ("{}\n", {"LLM_DEMO_ENABLED": "maybe"}, "expected a boolean"),
        ("- a list\n", {}, "expected a mapping"),
    ],
)
def test_bad_config_names_the_key(
    tmp_path: Path, yaml_text: str, env: dict[str, str], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        load_config(DemoConfig, "demo", path=write(tmp_path, yaml_text), env=env)


def test_explicit_missing_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        load_config(DemoConfig, "demo", path=tmp_path / "nope.yaml", env={})


def test_repository_config_loads() -> None:
    from tokenizer_svc.config import TokenizerConfig

    cfg = load_config(TokenizerConfig, "tokenizer", env={})
    assert cfg.port == 50061
    assert cfg.max_input_chars > 0
