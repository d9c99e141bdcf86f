"""NativeBackend's step thread: the engine is built on it, and what it applies mid-step."""

from __future__ import annotations

import asyncio
import threading

import pytest

from engine_svc.backends.base import GenerateInput
from engine_svc.backends.native import NativeBackend
from engine_svc.core.llm_engine import LLMEngine
from engine_svc.core.sampling_params import SamplingParams

from ..conftest import EngineFactory


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


def test_mid_step_poll_takes_new_requests_and_holds_aborts_until_the_step_ends(
    make_tiny_engine: EngineFactory,
) -> None:
    """Between two layers only additions are applied (one may interrupt the step); an
    abort, and whatever was queued after it, waits: the step still writes the blocks
    that an abort would free for reuse."""
    engine = make_tiny_engine()
    backend = NativeBackend(lambda: engine)
    loop = backend._loop = asyncio.new_event_loop()
    try:
        params = SamplingParams(max_tokens=2, ignore_eos=True)
        engine.add_request("running", [3, 4, 5], params)
        futs = [loop.create_future() for _ in range(2)]
        backend._cmds.put(("add", GenerateInput("early", [6, 7], params), futs[0]))
        backend._cmds.put(("abort", "running"))
        backend._cmds.put(("add", GenerateInput("late", [8, 9], params), futs[1]))
        backend._poll(engine)
        assert set(engine.scheduler.requests) == {"running", "early"}
        assert [c[0] for c in backend._held] == ["abort", "add"]
        backend._cmds.put(("abort", "early"))
        backend._poll(engine)  # still held: order is kept behind the first abort
        assert set(engine.scheduler.requests) == {"running", "early"}
        assert backend._drain_commands(engine, block=False)
        assert not backend._held
        assert set(engine.scheduler.requests) == {"late"}
        loop.run_until_complete(asyncio.sleep(0))  # the futures' answers
        assert [f.result() for f in futs] == [True, True]
    finally:
        loop.close()
