"""common.eager_send: named tasks start inside create_task, and behave as tasks after."""

from __future__ import annotations

import asyncio
import contextvars
import threading
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from common import eager_send

VAR: contextvars.ContextVar[str] = contextvars.ContextVar("var", default="unset")


class Sender:
    """Coroutines named as the eager set names them (``Sender.send``) or not."""

    def __init__(self) -> None:
        self.steps: list[str] = []
        self.gate: asyncio.Future[str] | None = None

    async def send(self) -> str:
        self.steps.append("first")
        VAR.set("in task")
        self.gate = asyncio.get_running_loop().create_future()
        try:
            got = await self.gate
        except asyncio.CancelledError:
            self.steps.append("cancelled")
            raise
        self.steps.append(f"then {got} {VAR.get()}")
        return got

    async def other(self) -> None:
        self.steps.append("other")

    async def fails_at_once(self) -> None:
        raise ValueError("refused")

    async def done_at_once(self) -> int:
        return 7


NAMES = frozenset({"Sender.send", "Sender.fails_at_once", "Sender.done_at_once"})


@pytest.fixture(autouse=True)
async def own_task_factory() -> AsyncIterator[None]:
    """The tests share one event loop: each puts back the task factory it found."""
    loop = asyncio.get_running_loop()
    found = loop.get_task_factory()
    yield
    loop.set_task_factory(found)


async def test_named_coroutine_runs_its_first_step_inside_create_task() -> None:
    eager_send.install(asyncio.get_running_loop(), NAMES)
    s = Sender()
    task = asyncio.get_running_loop().create_task(s.send())
    assert s.steps == ["first"]  # before this coroutine ever yielded to the loop
    assert VAR.get() == "unset"  # the step ran in the task's own context
    assert s.gate is not None
    s.gate.set_result("go")
    assert await task == "go"
    assert s.steps == ["first", "then go in task"]


async def test_a_named_task_keeps_its_name_and_an_explicit_lazy_start() -> None:
    eager_send.install(asyncio.get_running_loop(), NAMES)
    loop = asyncio.get_running_loop()
    factory = loop.get_task_factory()
    assert factory is not None
    s = Sender()
    named = factory(loop, s.send(), name="engine-send")  # type: ignore[call-arg]
    assert s.steps == ["first"]
    assert isinstance(named, asyncio.Task)
    assert named.get_name() == "engine-send"
    lazy = Sender()
    later = factory(loop, lazy.send(), eager_start=False)  # type: ignore[call-arg]
    assert lazy.steps == []
    for task in (named, later):
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_other_coroutines_start_on_the_loop_as_before() -> None:
    eager_send.install(asyncio.get_running_loop(), NAMES)
    s = Sender()
    task = asyncio.create_task(s.other())
    assert s.steps == []
    await task
    assert s.steps == ["other"]


async def test_a_cancel_while_it_waits_reaches_the_coroutine() -> None:
    eager_send.install(asyncio.get_running_loop(), NAMES)
    s = Sender()
    task = asyncio.get_running_loop().create_task(s.send())
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert task.cancelled()
    assert s.steps == ["first", "cancelled"]
    assert s.gate is not None
    assert s.gate.cancelled()


async def test_a_first_step_that_ends_the_coroutine_gives_a_finished_task() -> None:
    eager_send.install(asyncio.get_running_loop(), NAMES)
    s = Sender()
    loop = asyncio.get_running_loop()
    assert await loop.create_task(s.done_at_once()) == 7
    failing = loop.create_task(s.fails_at_once())
    with pytest.raises(ValueError, match="refused"):
        await failing


async def test_install_keeps_the_factory_it_found_and_is_idempotent() -> None:
    loop = asyncio.get_running_loop()
    made: list[str] = []

    def previous(
        loop: asyncio.AbstractEventLoop, coro: object, **kw: object
    ) -> asyncio.Task[object]:
        made.append(getattr(coro, "__qualname__", ""))
        return asyncio.Task(coro, loop=loop, **kw)  # type: ignore[arg-type]

    loop.set_task_factory(previous)  # type: ignore[arg-type]
    eager_send.install(loop, NAMES)
    factory = loop.get_task_factory()
    eager_send.install(loop, NAMES)
    assert loop.get_task_factory() is factory
    s = Sender()
    await asyncio.create_task(s.other())
    assert made == ["Sender.other"]


async def test_the_environment_switch_leaves_the_loop_as_it_was(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    loop = asyncio.get_running_loop()
    found = loop.get_task_factory()
    monkeypatch.setenv(eager_send.ENV_SWITCH, "0")
    eager_send.install(loop, NAMES)
    assert loop.get_task_factory() is found
    s = Sender()
    task = loop.create_task(s.send())
    assert s.steps == []  # started on the loop's turn, as without the module
    await asyncio.sleep(0)
    assert s.steps == ["first"]
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


@pytest.fixture
def threaded_server() -> Iterator[tuple[str, threading.Event]]:
    """A thread-pool gRPC server with ``/t.S/M`` (unary-stream, bytes): it sets the
    event when a request arrives, whatever the test's event loop is doing."""
    arrived = threading.Event()

    def handler(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        arrived.set()
        yield b"ok:" + request

    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    rpc = grpc.unary_stream_rpc_method_handler(handler)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("t.S", {"M": rpc})])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}", arrived
    finally:
        server.stop(None)


@pytest.mark.parametrize("eager", [True, False])
async def test_a_grpc_streaming_request_leaves_when_the_call_is_made(
    threaded_server: tuple[str, threading.Event], eager: bool
) -> None:
    address, arrived = threaded_server
    async with grpc.aio.insecure_channel(address) as channel:
        await channel.channel_ready()
        if eager:
            eager_send.install(asyncio.get_running_loop())
        call = channel.unary_stream("/t.S/M", None, None)(b"x")
        # blocking wait: this loop does not turn, so only a send already started gets out
        assert arrived.wait(5 if eager else 0.5) is eager
        assert [m async for m in call] == [b"ok:x"]
        assert arrived.is_set()
