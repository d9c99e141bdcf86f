"""The ``engine`` section: native is the only backend, and a config from before the
in-process vLLM backend was removed is refused with what to run instead."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.config import load_config
from engine_svc.__main__ import main
from engine_svc.config import EngineServiceConfig


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "stack.yaml"
    path.write_text(text)
    return path


def test_native_is_the_default_and_may_be_named(tmp_path: Path) -> None:
    assert load_config(EngineServiceConfig, "engine", path=write(tmp_path, "{}\n"), env={})
    named = write(tmp_path, "engine:\n  backend: native\n")
    assert load_config(EngineServiceConfig, "engine", path=named, env={}).backend == "native"


@pytest.mark.parametrize(
    ("yaml", "env"),
    [("engine:\n  backend: vllm\n", {}), ("{}\n", {"LLM_ENGINE_BACKEND": "vllm"})],
    ids=["yaml", "env"],
)
def test_backend_vllm_says_to_run_the_stock_server(
    tmp_path: Path, yaml: str, env: dict[str, str]
) -> None:
    with pytest.raises(ValueError, match=r"\[engine\] backend: vllm") as err:
        load_config(EngineServiceConfig, "engine", path=write(tmp_path, yaml), env=env)
    for what in ("vllm serve <model dir> --grpc", "deploy/stock_vllm.py", "vllm://host:port"):
        assert what in str(err.value)


def test_backend_flag_vllm_is_refused_before_anything_starts(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="stock gRPC server"):
        main(["--config", str(write(tmp_path, "{}\n")), "--backend", "vllm"])


def test_another_backend_is_refused_naming_the_one_there_is(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown backend 'trtllm'; the only one is native"):
        load_config(
            EngineServiceConfig,
            "engine",
            path=write(tmp_path, "engine:\n  backend: trtllm\n"),
            env={},
        )


def test_the_removed_vllm_key_is_unknown(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['vllm_enforce_eager'\]"):
        load_config(
            EngineServiceConfig,
            "engine",
            path=write(tmp_path, "engine:\n  vllm_enforce_eager: true\n"),
            env={},
        )
