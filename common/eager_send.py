"""Streaming gRPC calls whose request goes out when the call is made, not a loop turn later.

grpc.aio sends a unary-stream call's request from a task it creates for the call
(``UnaryStreamCall._send_unary_request``). asyncio runs that task after every task
already ready, so when a burst of requests arrives in one loop turn (an HTTP front
reads many connections' requests at once), each handler's admission runs before
any of their engine requests leaves: the whole burst reaches the engine as late as
the last admission ends.

``install`` sets a task factory on the running loop that starts just those send
tasks eagerly: their first step (serializing the request and starting the gRPC
batch that writes it) runs inside ``loop.create_task``, in the new task's own
context, and the task takes over from the first point where it waits, as
Python 3.12's eager tasks do (used natively there). Every other task is created
as before, by the factory that was set (or the loop's default).
``LLM_EAGER_SEND=0`` in a service's environment leaves its loop as it was.
"""

from __future__ import annotations

import asyncio
import contextvars
import os
import sys
import types
from collections.abc import Coroutine, Generator
from typing import Any

# the coroutines started eagerly (by __qualname__): the send of grpc.aio's unary-stream call
EAGER_COROUTINES = frozenset({"UnaryStreamCall._send_unary_request"})
ENV_SWITCH = "LLM_EAGER_SEND"  # "0": off (the sends wait for their loop turn, as stock grpc.aio)
NATIVE = sys.version_info >= (3, 12)  # asyncio.Task(eager_start=True) exists


def enabled() -> bool:
    """Whether ``install`` installs anything in this environment (``LLM_EAGER_SEND``)."""
    return os.environ.get(ENV_SWITCH, "1") != "0"


@types.coroutine
def _relay(yielded: Any) -> Generator[Any, Any, Any]:
    """Hand what the wrapped coroutine yielded (a future it waits for) to the task."""
    return (yield yielded)


async def _resume(coro: Coroutine[Any, Any, Any], yielded: Any) -> Any:
    """Drive ``coro`` on from its first wait (``yielded``), exactly as its own task
    would: what the task sends or throws in goes to ``coro``."""
    while True:
        try:
            sent = await _relay(yielded)
        except BaseException as exc:  # cancelled, or closed: coro decides what follows
            try:
                yielded = coro.throw(exc)
            except StopIteration as stop:
                return stop.value
            continue
        try:
            yielded = coro.send(sent)
        except StopIteration as stop:
            return stop.value


async def _finished(value: Any) -> Any:
    return value


async def _failed(exc: BaseException) -> Any:
    raise exc


def eager_task(
    loop: asyncio.AbstractEventLoop,
    coro: Coroutine[Any, Any, Any],
    context: contextvars.Context | None = None,
) -> asyncio.Task[Any]:
    """A task of ``coro`` whose first step has run already (in ``context``, or a copy
    of the current one)."""
    if NATIVE:
        return asyncio.Task(coro, loop=loop, context=context, eager_start=True)  # type: ignore[call-arg,unused-ignore]
    ctx = context if context is not None else contextvars.copy_context()
    try:
        yielded = ctx.run(coro.send, None)
    except StopIteration as stop:
        return asyncio.Task(_finished(stop.value), loop=loop, context=ctx)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # the task fails with it, as a lazily started one would
        return asyncio.Task(_failed(exc), loop=loop, context=ctx)
    return asyncio.Task(_resume(coro, yielded), loop=loop, context=ctx)


def install(loop: asyncio.AbstractEventLoop, names: frozenset[str] = EAGER_COROUTINES) -> None:
    """Start the tasks of the coroutines named ``names`` (``__qualname__``) eagerly on
    ``loop`` from now on; the first call on a loop counts, later ones do nothing.
    ``LLM_EAGER_SEND=0`` in the environment: nothing is installed."""
    if not enabled():
        return
    previous = loop.get_task_factory()
    if getattr(previous, "eager_send", False):
        return

    def factory(
        loop: asyncio.AbstractEventLoop, coro: Any, context: Any = None, **kwargs: Any
    ) -> asyncio.Future[Any]:
        # newer loops pass name= and eager_start= too: an explicit eager_start=False
        # keeps the task lazy, a name is kept
        if getattr(coro, "__qualname__", "") in names and kwargs.get("eager_start") is not False:
            task = eager_task(loop, coro, context)
            if kwargs.get("name"):
                task.set_name(kwargs["name"])
            return task
        if not NATIVE:  # no eager_start there: every task starts lazily
            kwargs.pop("eager_start", None)
        if previous is not None:
            extra = {"context": context} if context is not None else {}
            return previous(loop, coro, **extra, **kwargs)  # type: ignore[call-arg]
        return asyncio.Task(coro, loop=loop, context=context, **kwargs)

    factory.eager_send = True  # type: ignore[attr-defined]
    loop.set_task_factory(factory)  # type: ignore[arg-type]
