"""Background asyncio tasks: stop them and wait until they are gone."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine
from typing import Any, Generic, TypeVar

K = TypeVar("K")


async def cancel_and_wait(*tasks: asyncio.Task[Any] | None) -> None:
    """Cancel every task given (None is skipped) and wait for each to finish; their
    cancellation is not re-raised here (a cancel of the caller still is)."""
    live = [t for t in tasks if t is not None]
    for task in live:
        task.cancel()
    for task in live:
        with contextlib.suppress(asyncio.CancelledError):
            await task


class BackgroundOnce(Generic[K]):
    """At most one background task per key (re-reads beside the request path, say):
    ``start`` does nothing while that key's task runs; ``close`` stops them all.

    A task's coroutine handles (logs) its own errors: nobody awaits it.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._tasks: dict[K, asyncio.Task[None]] = {}

    def __len__(self) -> int:
        """Tasks still running."""
        return sum(not t.done() for t in self._tasks.values())

    def __contains__(self, key: K) -> bool:
        task = self._tasks.get(key)
        return task is not None and not task.done()

    def start(self, key: K, work: Callable[[], Coroutine[Any, Any, None]]) -> bool:
        """Run ``work()`` in the background unless ``key``'s task is still running."""
        running = self._tasks.get(key)
        if running is not None and not running.done():
            return False
        task = asyncio.get_running_loop().create_task(work(), name=self.name)
        self._tasks[key] = task
        task.add_done_callback(lambda t: self._forget(key, t))
        return True

    def _forget(self, key: K, task: asyncio.Task[None]) -> None:
        if self._tasks.get(key) is task:
            del self._tasks[key]

    async def close(self) -> None:
        """Stop every task in flight and wait for them (at shutdown)."""
        await cancel_and_wait(*self._tasks.values())
        self._tasks.clear()
