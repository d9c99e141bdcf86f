"""NativeBackend's start-up: the engine is built on the step thread itself."""

from __future__ import annotations

import asyncio
import threading

import pytest

from engine_svc.backends.native import NativeBackend
from engine_svc.core.llm_engine import LLMEngine


def test_engine_is_built_on_the_step_thread_and_a_failed_build_surfaces() -> None:
    # One thread makes every torch call: a second thread calling torch gets its
    # own OpenMP team, and more OpenMP threads than CPUs stops libgomp spinning
    # between parallel regions (each decode step then waits on futex wakes).
    built_on: list[str] = []

    def factory() -> LLMEngine:
        built_on.append(threading.current_thread().name)
        raise RuntimeError("no weights in this test")

    backend = NativeBackend(factory)
    before = {t.ident for t in threading.enumerate()}

    with pytest.raises(RuntimeError, match="no weights in this test"):
        asyncio.run(backend.start())

    assert built_on == ["engine-step-loop"]
    assert backend._thread is None  # joined, not left behind
    assert not [
        t for t in threading.enumerate() if t.ident not in before and t.name == "engine-step-loop"
    ]
