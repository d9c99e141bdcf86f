"""Nested config sections: ``<section>.<sub>.<knob>`` in YAML, ``LLM_<SECTION>_<SUB>_<KNOB>``
in the environment, and the deprecated flat names of the knobs."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest

from common.config import NOT_A_KEY, config_keys, deprecated_flat_names, load_config
from engine_svc.core.config import EngineConfig
from gateway.config import GatewayConfig


@dataclasses.dataclass(frozen=True, slots=True)
class Limits:
    size: int = 4
    ratio: float = 0.5
    derived: int = dataclasses.field(default=0, metadata=NOT_A_KEY)


@dataclasses.dataclass(slots=True)
class DemoConfig:
    name: str = "demo"
    limits: Limits = dataclasses.field(
        default_factory=Limits, metadata=deprecated_flat_names("limit_")
    )
    plain: Limits = dataclasses.field(default_factory=Limits)


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "stack.yaml"
    p.write_text(text)
    return p


def load(tmp_path: Path, text: str, env: dict[str, str] | None = None) -> DemoConfig:
    return load_config(DemoConfig, "demo", path=write(tmp_path, text), env=env or {})


def test_yaml_nested_section(tmp_path: Path) -> None:
    cfg = load(tmp_path, "demo:\n  name: x\n  limits:\n    size: 8\n")
    assert cfg == DemoConfig(name="x", limits=Limits(size=8))


def test_env_overrides_a_nested_knob(tmp_path: Path) -> None:
    cfg = load(tmp_path, "demo:\n  limits: {size: 8}\n", {"LLM_DEMO_LIMITS_RATIO": "0.25"})
    assert cfg.limits == Limits(size=8, ratio=0.25)


def test_overrides_as_dotted_names_or_a_mapping(tmp_path: Path) -> None:
    p = write(tmp_path, "demo:\n  limits: {size: 8}\n")
    dotted = load_config(DemoConfig, "demo", path=p, env={}, overrides={"limits.ratio": 0.1})
    mapping = load_config(DemoConfig, "demo", path=p, env={}, overrides={"limits": {"ratio": 0.1}})
    assert dotted.limits == mapping.limits == Limits(size=8, ratio=0.1)
    none = load_config(DemoConfig, "demo", path=p, env={}, overrides={"limits.size": None})
    assert none.limits.size == 8  # None = the flag was not given
    with pytest.raises(ValueError, match=r"unknown option 'sise' for \[demo.limits\]"):
        load_config(DemoConfig, "demo", path=p, env={}, overrides={"limits.sise": 1})


@pytest.mark.parametrize(
    ("yaml_text", "env", "match"),
    [
        (
            "demo:\n  limits: {sise: 1}\n",
            {},
            r"\[demo.limits\]: unknown key\(s\) \['sise'\]; valid keys: \['ratio', 'size'\]",
        ),
        ("demo:\n  limits: {derived: 1}\n", {}, r"unknown key\(s\) \['derived'\]"),
        ("demo:\n  limits: 3\n", {}, r"\[demo.limits\]: expected a mapping, got 3"),
        ("demo:\n  limits: {size: big}\n", {}, r"\[demo.limits\] size: expected int, got 'big'"),
        ("{}\n", {"LLM_DEMO_PLAIN_SIZE": "big"}, r"\[demo.plain\] size: expected int"),
    ],
)
def test_bad_nested_config_names_the_key(
    tmp_path: Path, yaml_text: str, env: dict[str, str], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        load(tmp_path, yaml_text, env)


def test_flat_names_are_read_with_a_warning_naming_the_new_key(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="common.config"):
        cfg = load(tmp_path, "demo:\n  limit_size: 8\n", {"LLM_DEMO_LIMIT_RATIO": "0.25"})
    assert cfg.limits == Limits(size=8, ratio=0.25)
    text = caplog.text
    assert "demo.limit_size" in text
    assert "use demo.limits.size" in text
    assert "LLM_DEMO_LIMIT_RATIO" in text
    assert "use LLM_DEMO_LIMITS_RATIO" in text
    assert "deprecated" in text


def test_a_flat_name_beside_its_new_name_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"both limit_size and limits.size .* demo.limits.size"):
        load(tmp_path, "demo:\n  limit_size: 8\n  limits: {size: 9}\n")
    env = {"LLM_DEMO_LIMIT_SIZE": "8", "LLM_DEMO_LIMITS_SIZE": "9"}
    with pytest.raises(ValueError, match="keep only LLM_DEMO_LIMITS_SIZE"):
        load(tmp_path, "{}\n", env)


def test_a_section_without_flat_names_refuses_them(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['size'\]"):
        load(tmp_path, "demo:\n  size: 8\n")


def test_config_keys_flattens_sub_sections() -> None:
    keys = [(k.path, k.env) for k in config_keys(DemoConfig, "demo")]
    assert keys == [
        ("name", "LLM_DEMO_NAME"),
        ("limits.size", "LLM_DEMO_LIMITS_SIZE"),
        ("limits.ratio", "LLM_DEMO_LIMITS_RATIO"),
        ("plain.size", "LLM_DEMO_PLAIN_SIZE"),
        ("plain.ratio", "LLM_DEMO_PLAIN_RATIO"),
    ]


def test_engine_scheduler_section(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    p = write(tmp_path, "engine_core:\n  max_model_len: 2048\n  scheduler: {max_num_seqs: 4}\n")
    env = {"LLM_ENGINE_CORE_SCHEDULER_FAIR_SHARE": "false"}
    cfg = load_config(EngineConfig, "engine_core", path=p, env=env)
    assert (cfg.scheduler.max_num_seqs, cfg.scheduler.fair_share) == (4, False)
    assert cfg.scheduler_config(8192).max_model_len == 2048  # the engine's key, resolved
    with caplog.at_level(logging.WARNING, logger="common.config"):
        old = load_config(
            EngineConfig, "engine_core", path=p, env={"LLM_ENGINE_CORE_MAX_WAITING": "2"}
        )
    assert old.scheduler.max_waiting == 2
    assert "use LLM_ENGINE_CORE_SCHEDULER_MAX_WAITING" in caplog.text
    with pytest.raises(ValueError, match=r"\[engine_core.scheduler\] max_num_seqs"):
        load_config(
            EngineConfig, "engine_core", path=p, env={"LLM_ENGINE_CORE_SCHEDULER_MAX_NUM_SEQS": "0"}
        )


def test_a_knob_that_never_was_flat_has_no_flat_name(tmp_path: Path) -> None:
    p = write(tmp_path, "engine_core:\n  watermark: 0.1\n")
    with pytest.raises(ValueError, match=r"\[engine_core\]: unknown key\(s\) \['watermark'\]"):
        load_config(EngineConfig, "engine_core", path=p, env={})


def test_gateway_breaker_section(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    p = write(tmp_path, "gateway:\n  breaker: {open_s: 2}\n")
    env = {"LLM_GATEWAY_BREAKER_CONSECUTIVE_FAILURES": "1"}  # the same name before and now
    cfg = load_config(GatewayConfig, "gateway", path=p, env=env)
    assert (cfg.breaker.open_s, cfg.breaker.consecutive_failures) == (2.0, 1)
    assert "deprecated" not in caplog.text
    with caplog.at_level(logging.WARNING, logger="common.config"):
        old = load_config(
            GatewayConfig,
            "gateway",
            path=write(tmp_path, "gateway:\n  breaker_open_s: 3\n"),
            env={},
        )
    assert old.breaker.open_s == 3.0
    assert "gateway.breaker_open_s" in caplog.text
    assert "use gateway.breaker.open_s" in caplog.text
    for bad, match in [
        ("error_ratio: 2", "error_ratio must be in"),
        ("min_calls: 0", "min_calls must be > 0"),
    ]:
        with pytest.raises(ValueError, match=rf"\[gateway.breaker\] {match}"):
            load_config(
                GatewayConfig,
                "gateway",
                path=write(tmp_path, f"gateway:\n  breaker: {{{bad}}}\n"),
                env={},
            )


def test_repository_config_loads_the_sub_sections() -> None:
    core = load_config(EngineConfig, "engine_core", env={})
    assert core.scheduler.max_num_seqs == 32
    gw = load_config(GatewayConfig, "gateway", env={})
    assert gw.breaker.consecutive_failures == 5
