"""Session-wide fixtures: the prepared model and the tokenizer service.

Servers run as real subprocesses on ephemeral ports (they write their bound
ports to a port file) and are always stopped at the end of the session.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

from common.config import default_model_dir
from common.procs import ManagedProcess

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# CI is a gate: the same examples every run (a failure there is reproducible, never a
# coin toss). Local runs keep drawing new examples, which is where hypothesis finds bugs.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI") == "true":
    settings.load_profile("ci")


@pytest.fixture(scope="session")
def model_dir() -> Path:
    d = default_model_dir()
    if not (d / "manifest.json").exists():
        pytest.fail(f"model not prepared at {d}: run `make model` (make test does it)")
    return d


ENGINE_TEST_ENV = {
    # fp32 for results that compare exactly with an offline engine; a small pool
    "LLM_ENGINE_CORE_DTYPE": "float32",
    # deploy/gpu-check.sh sets LLM_TEST_ENGINE_DEVICE=cuda to run these on a GPU
    "LLM_ENGINE_CORE_DEVICE": os.environ.get("LLM_TEST_ENGINE_DEVICE", "cpu"),
    "LLM_ENGINE_CORE_NUM_KV_BLOCKS": "512",
    "LLM_ENGINE_CORE_SCHEDULER_MAX_NUM_SEQS": "16",
    "LLM_ENGINE_CORE_SCHEDULER_MAX_NUM_BATCHED_TOKENS": "256",
    "LLM_ENGINE_CORE_MAX_MODEL_LEN": "2048",
    "LLM_ENGINE_GRACE_SECONDS": "5",
}


@pytest.fixture(scope="session", autouse=True)
def compute_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One compute cache per test session (never the user's ``~/.cache``): the first
    engine of a configuration measures its compute paths, the next ones apply what it
    measured, in-process and subprocess engines alike."""
    from engine_svc.models import compute_cache

    d = tmp_path_factory.mktemp("compute-cache")
    ENGINE_TEST_ENV["LLM_ENGINE_CORE_COMPUTE_CACHE_DIR"] = str(d)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(compute_cache, "default_dir", lambda: d)
        mp.setenv("LLM_ENGINE_CORE_COMPUTE_CACHE_DIR", str(d))  # engines `make run` starts
        yield d


def start_engine(
    name: str,
    model_dir: Path,
    log_dir: Path,
    env: dict[str, str] | None = None,
    args: list[str] | None = None,
    timeout: float = 180,
) -> ManagedProcess:
    """A real engine replica (native backend unless ``args`` say otherwise, real model)
    on ephemeral ports."""
    proc = ManagedProcess(
        name=name,
        module="engine_svc",
        args=[
            "--port",
            "0",
            "--metrics-port",
            "0",
            "--model-dir",
            str(model_dir),
            "--log-format",
            "json",
            *(args or []),
        ],
        env={**ENGINE_TEST_ENV, **(env or {})},
        log_dir=log_dir,
    )
    return proc.start(timeout=timeout)


@contextlib.contextmanager
def engine_running(
    name: str,
    model_dir: Path,
    log_dir: Path,
    env: dict[str, str] | None = None,
    args: list[str] | None = None,
) -> Iterator[ManagedProcess]:
    """``start_engine`` for a fixture: stopped (by pid) when the block ends."""
    proc = start_engine(name, model_dir, log_dir, env=env, args=args)
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="session")
def engine_server(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ManagedProcess]:
    proc = start_engine("engine", model_dir, tmp_path_factory.mktemp("engine-logs"))
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="session")
def tokenizer_server(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ManagedProcess]:
    proc = ManagedProcess(
        name="tokenizer",
        module="tokenizer_svc",
        args=[
            "--port",
            "0",
            "--metrics-port",
            "0",
            "--model-dir",
            str(model_dir),
            "--log-format",
            "json",
        ],
        env={"LLM_TOKENIZER_MAX_INPUT_CHARS": "20000"},
        log_dir=tmp_path_factory.mktemp("tokenizer-logs"),
    )
    proc.start(timeout=60)
    try:
        yield proc
    finally:
        proc.stop()
