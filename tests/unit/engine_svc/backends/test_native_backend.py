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


def test_mid_step_poll_applies_what_is_safe_and_holds_the_rest_in_order(
    make_tiny_engine: EngineFactory,
) -> None:
    """Between two layers: additions and aborts of requests the step does not run are
    applied (an addition may interrupt the step); an abort of a request the step runs
    waits for the step's end (the step still writes the blocks it would free), and so
    does a new request under that id; a stop, and everything after it, waits too."""
    engine = make_tiny_engine()
    backend = NativeBackend(lambda: engine)
    loop = backend._loop = asyncio.new_event_loop()
    try:
        params = SamplingParams(max_tokens=2, ignore_eos=True)
        engine.add_request("running", [3, 4, 5], params)
        engine.in_flight_request_ids = frozenset({"running"})  # as inside its step
        futs = [loop.create_future() for _ in range(4)]
        for cmd in (
            ("add", GenerateInput("early", [6, 7], params), futs[0]),
            ("abort", "running"),
            ("add", GenerateInput("late", [8, 9], params), futs[1]),
            ("add", GenerateInput("running", [1, 2], params), futs[2]),  # a retry, same id
            ("abort", "early"),
        ):
            backend._cmds.put(cmd)
        backend._poll(engine)
        assert set(engine.scheduler.requests) == {"running", "late"}  # early: aborted at once
        assert [(c[0], getattr(c[1], "request_id", c[1])) for c in backend._held] == [
            ("abort", "running"),
            ("add", "running"),
        ]
        backend._cmds.put(("stop",))
        backend._cmds.put(("add", GenerateInput("after-stop", [5], params), futs[3]))
        backend._poll(engine)
        assert [c[0] for c in backend._held] == ["abort", "add", "stop", "add"]
        assert "after-stop" not in engine.scheduler.requests
        engine.in_flight_request_ids = frozenset()  # the step ended
        assert not backend._drain_commands(engine, block=False)  # ran up to the stop
        assert engine.scheduler.requests["running"].prompt_token_ids == [1, 2]  # the retry
        assert set(engine.scheduler.requests) == {"running", "late"}
        loop.run_until_complete(asyncio.sleep(0))  # the futures' answers
        assert [f.result() for f in futs[:3]] == [True, True, True]
        assert not futs[3].done()  # behind the stop, as before a stop between steps
    finally:
        loop.close()
