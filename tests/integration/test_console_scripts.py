"""The installed console scripts (pyproject's [project.scripts]) as a user runs them: from
a directory outside the repository, with no PYTHONPATH, so every import (the generated
llm/ included) comes through the venv's editable install and nothing through the
working directory. llm-client chats with a real gateway over the session's engine and
tokenizer; llm-engine-client asks that engine directly."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from common.procs import ManagedProcess
from common.redis_server import RedisServer
from tests.integration.gateway.conftest import GatewayProcess, start_gateway

pytestmark = pytest.mark.integration
SCRIPTS = ("llm-client", "llm-engine-client", "llm-prepare-model")
BIN = Path(sys.executable).parent


def clean_env(home: Path) -> dict[str, str]:
    """A login shell's environment: no PYTHONPATH, no LLM_* settings of the test run,
    and a run directory of its own (no make run's keys or token)."""
    return {
        "PATH": f"{BIN}{os.pathsep}/usr/bin{os.pathsep}/bin",
        "HOME": str(home),
        "LANG": "C.UTF-8",
        "HF_HUB_OFFLINE": "1",
        "LLM_RUN_DIR": str(home / "run"),
    }


def run_script(name: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / name), *args],
        cwd=cwd,
        env=clean_env(cwd),
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture(scope="module")
def live_gateway(
    engine_server: ManagedProcess,
    tokenizer_server: ManagedProcess,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[GatewayProcess]:
    """A gateway over the session's engine and tokenizer, with a Redis of its own."""
    with RedisServer() as redis:
        gw = start_gateway(
            "gateway-scripts",
            [engine_server.address],
            tokenizer_server.address,
            redis.url,
            tmp_path_factory.mktemp("gateway-scripts"),
        )
        try:
            yield gw
        finally:
            gw.stop()


@pytest.mark.parametrize("name", SCRIPTS)
def test_console_script_help_runs_outside_the_repository(name: str, tmp_path: Path) -> None:
    assert (BIN / name).is_file(), f"{name} is not installed in {BIN}: run `make install`"
    out = run_script(name, "--help", cwd=tmp_path)
    assert out.returncode == 0, out.stderr  # a ModuleNotFoundError lands here
    assert out.stdout.startswith("usage:"), out.stdout


def test_llm_client_chats_through_a_live_gateway(
    live_gateway: GatewayProcess, tmp_path: Path
) -> None:
    _, key = live_gateway.tenant(requests_per_minute=60)
    out = run_script(
        "llm-client",
        "--address",
        live_gateway.proc.address,
        "--plaintext",
        "--api-key",
        key,
        "chat",
        "What is the capital of France?",
        "--max-tokens",
        "4",
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip(), out.stderr  # the answer's text
    assert "completion 4" in out.stderr or "[STOP]" in out.stderr, out.stderr


def test_llm_engine_client_asks_the_engine_directly(
    engine_server: ManagedProcess, tokenizer_server: ManagedProcess, tmp_path: Path
) -> None:
    out = run_script(
        "llm-engine-client",
        "--address",
        engine_server.address,
        "--tokenizer",
        tokenizer_server.address,
        "--max-tokens",
        "3",
        "Hi",
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    assert "completion 3" in out.stderr, out.stderr


def test_llm_prepare_model_verifies_the_prepared_model(model_dir: Path, tmp_path: Path) -> None:
    out = run_script(
        "llm-prepare-model", "--verify-only", "--model-dir", str(model_dir), cwd=tmp_path
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert str(model_dir) in out.stdout
