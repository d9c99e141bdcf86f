"""A local snapshot of a shared name -> value table, never older than ``ttl_s``.

What the request path reads for routing policies and model routes: one dict
lookup. ``ttl_s`` is the bound on how long another replica acts on an old
value (the replica that writes updates its own snapshot at once). Once the
snapshot is half that old, a lookup starts a re-read in the background and
answers from the snapshot it has (refresh-ahead), so with steady traffic no
request waits for the store; only a snapshot past ``ttl_s`` (or the first
one) is re-read on the request's path. A failed refresh keeps the last good
snapshot for another ``ttl_s``.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

from common.log import get_logger
from common.tasks import BackgroundOnce
from ratelimit.errors import StoreError
from ratelimit.redis_client import RedisClient
from ratelimit.tenancy.registry import redis_errors

log = get_logger(__name__)
V = TypeVar("V")


async def read_json_hash(
    client: RedisClient, key: str, parse: Callable[[str, dict[str, Any]], V], what: str
) -> dict[str, V]:
    """A Redis hash of name -> JSON, parsed by ``parse(name, dict)``; an entry that does not
    parse (ValueError, KeyError, TypeError) is logged and skipped. Raises ``StoreError``."""
    with redis_errors(f"{what} read"):
        raw = await client.hgetall(key)
    out: dict[str, V] = {}
    for k, text in raw.items():
        name = k if isinstance(k, str) else k.decode()
        try:
            out[name] = parse(name, json.loads(text))
        except (ValueError, KeyError, TypeError) as e:
            log.error(f"ignoring a corrupt entry of {what} in redis", name=name, error=str(e))
    return out


class SnapshotCache(Generic[V]):
    """A name -> value table read whole from its store, at most ``ttl_s`` old.

    Args:
        load: Reads the whole table (raises ``StoreError``).
        ttl_s: Longest time a snapshot is used without reading the store again.
        what: Name of the table for logs.
        clock: Monotonic seconds.
    """

    def __init__(
        self,
        load: Callable[[], Awaitable[dict[str, V]]],
        ttl_s: float,
        what: str,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._load = load
        self._clock = clock
        self.ttl_s = ttl_s
        self.what = what
        self._values: dict[str, V] = {}
        self._fresh_until = 0.0  # past this, a lookup re-reads the store first
        self._refresh_after = 0.0  # past this, a lookup starts a re-read beside it
        self._lock = asyncio.Lock()
        self._ahead = BackgroundOnce[None](f"refresh {what}")  # the re-read beside lookups
        self.num_refreshes = 0  # store reads (on a request's path or ahead of it)
        self.num_waited = 0  # of them, the ones a lookup waited for

    async def get(self, name: str) -> V | None:
        """The value of ``name`` (None = absent)."""
        await self._refresh_if_stale()
        return self._values.get(name)

    async def all(self) -> dict[str, V]:
        """Every value by name."""
        await self._refresh_if_stale()
        return dict(self._values)

    async def _refresh_if_stale(self) -> None:
        now = self._clock()
        if now < self._refresh_after:
            return
        if now < self._fresh_until:  # half its age left: re-read beside this lookup
            if not self._lock.locked():
                self._ahead.start(None, self._refresh_ahead)
            return
        async with self._lock:
            if self._clock() < self._fresh_until:
                return
            self.num_waited += 1
            await self._refresh()

    async def _refresh_ahead(self) -> None:
        try:
            async with self._lock:
                if self._clock() < self._refresh_after:  # another read got there first
                    return
                await self._refresh()
        except Exception:  # no request waits on this task to see it: log it
            log.exception(f"refreshing {self.what} failed; keeping the last good ones")

    async def _refresh(self) -> None:
        """Read the store (the caller holds the lock)."""
        started = self._clock()  # the snapshot is as old as the read's start
        self.num_refreshes += 1
        try:
            self._values = await self._load()
        except StoreError as e:
            log.warning(f"cannot refresh {self.what}; keeping the last good ones", error=str(e))
        self._fresh_until = started + self.ttl_s
        self._refresh_after = started + self.ttl_s / 2

    async def close(self) -> None:
        """Stop a re-read in flight (at shutdown)."""
        await self._ahead.close()

    def set_local(self, name: str, value: V | None) -> None:
        """Apply a write this replica made (None = deleted) without waiting for a refresh."""
        if value is None:
            self._values.pop(name, None)
        else:
            self._values[name] = value

    def invalidate(self) -> None:
        """Re-read the store on the next lookup."""
        self._fresh_until = self._refresh_after = 0.0
