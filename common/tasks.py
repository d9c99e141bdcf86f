"""Background asyncio tasks: stop them and wait until they are gone."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any


async def cancel_and_wait(*tasks: asyncio.Task[Any] | None) -> None:
    """Cancel every task given (None is skipped) and wait for each to finish; their
    cancellation is not re-raised here (a cancel of the caller still is)."""
    live = [t for t in tasks if t is not None]
    for task in live:
        task.cancel()
    for task in live:
        with contextlib.suppress(asyncio.CancelledError):
            await task
