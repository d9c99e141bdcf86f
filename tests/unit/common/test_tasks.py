"""Background tasks: one per key at a time, and nothing left running after close."""

from __future__ import annotations

import asyncio

from hypothesis import given, settings
from hypothesis import strategies as st

from common.tasks import BackgroundOnce


async def test_a_key_runs_one_task_at_a_time_and_can_run_again_once_it_ended() -> None:
    once = BackgroundOnce[str]("t")
    gate = asyncio.Event()
    runs: list[str] = []

    async def work(key: str) -> None:
        runs.append(key)
        await gate.wait()

    assert once.start("a", lambda: work("a"))
    assert not once.start("a", lambda: work("a"))  # still running
    assert once.start("b", lambda: work("b"))
    await asyncio.sleep(0)
    assert runs == ["a", "b"]
    assert len(once) == 2
    assert "a" in once
    gate.set()
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert len(once) == 0
    assert "a" not in once
    gate.clear()
    assert once.start("a", lambda: work("a"))
    await once.close()
    assert len(once) == 0


async def test_a_failing_task_is_forgotten_too() -> None:
    once = BackgroundOnce[int]("t")

    async def boom() -> None:
        raise RuntimeError("x")

    once.start(1, boom)
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert len(once) == 0
    assert once.start(1, boom)
    await once.close()


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abc"), st.booleans()), max_size=30))
def test_close_leaves_no_task_running(steps: list[tuple[str, bool]]) -> None:
    """Whatever starts and finishes in whatever order, at most one task per key runs
    at once, and close() leaves none behind."""

    async def scenario() -> None:
        once = BackgroundOnce[str]("t")
        running: dict[str, int] = {}
        gates = {k: asyncio.Event() for k in "abc"}

        async def work(key: str) -> None:
            running[key] = running.get(key, 0) + 1
            assert running[key] == 1
            try:
                await gates[key].wait()
            finally:
                running[key] -= 1

        for key, finish in steps:
            if finish:
                gates[key].set()
                await asyncio.sleep(0)
                gates[key] = asyncio.Event()
            else:
                once.start(key, lambda key=key: work(key))  # type: ignore[misc]
            await asyncio.sleep(0)
        before = {t for t in asyncio.all_tasks() if t.get_name() == "t"}
        await once.close()
        assert all(t.done() for t in before)
        assert len(once) == 0
        assert not any(running.values())

    asyncio.run(scenario())
