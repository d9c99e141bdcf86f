"""A local snapshot of a shared name -> value table, re-read at most every ``ttl_s``.

What the request path reads for routing policies and model routes: one dict
lookup, with the store read again once the snapshot is older than ``ttl_s``
(the bound on how long another replica acts on an old value; the replica that
writes updates its own snapshot at once). A failed refresh keeps the last good
snapshot.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

from common.log import get_logger
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
    """

    def __init__(
        self, load: Callable[[], Awaitable[dict[str, V]]], ttl_s: float, what: str
    ) -> None:
        self._load = load
        self.ttl_s = ttl_s
        self.what = what
        self._values: dict[str, V] = {}
        self._fresh_until = 0.0
        self._lock = asyncio.Lock()

    async def get(self, name: str) -> V | None:
        """The value of ``name`` (None = absent)."""
        await self._refresh_if_stale()
        return self._values.get(name)

    async def all(self) -> dict[str, V]:
        """Every value by name."""
        await self._refresh_if_stale()
        return dict(self._values)

    async def _refresh_if_stale(self) -> None:
        if time.monotonic() < self._fresh_until:
            return
        async with self._lock:
            if time.monotonic() < self._fresh_until:
                return
            try:
                self._values = await self._load()
            except StoreError as e:
                log.warning(f"cannot refresh {self.what}; keeping the last good ones", error=str(e))
            self._fresh_until = time.monotonic() + self.ttl_s

    def set_local(self, name: str, value: V | None) -> None:
        """Apply a write this replica made (None = deleted) without waiting for a refresh."""
        if value is None:
            self._values.pop(name, None)
        else:
            self._values[name] = value

    def invalidate(self) -> None:
        """Re-read the store on the next lookup."""
        self._fresh_until = 0.0
