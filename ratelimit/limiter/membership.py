"""Live gateway replicas, counted in Redis, for the fail-open share.

When Redis is unreachable each gateway admits from local buckets holding
``policy / N``. A fixed N is wrong as soon as the deployment scales (an HPA
adds replicas: the tenant gets N_live / N times its limit) or loses replicas
(the tenant gets less). So every replica keeps an entry in one sorted set,
``<prefix>replicas`` (member = replica id, score = expiry on Redis's clock),
refreshed every ``ttl / 3``; an entry not refreshed within ``ttl`` no longer
counts. The limiter divides by the last count read while Redis answered, and
by the configured ``num_replicas`` until the first count arrives.

While Redis is down the count cannot change: the share stays what it was at
the moment Redis went away, which is the best knowledge any replica has.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import uuid
from collections.abc import Callable

from common.log import get_logger
from common.tasks import cancel_and_wait
from ratelimit import metrics
from ratelimit.errors import StoreError
from ratelimit.limiter.lua import REPLICAS
from ratelimit.redis_client import RedisClient, store_errors
from ratelimit.redis_scripts import LuaScript

log = get_logger(__name__)
_SCRIPT = LuaScript("replicas", REPLICAS)
_FAILURES: tuple[type[Exception], ...] = (StoreError, TimeoutError)


def replica_id() -> str:
    """``host:pid:random``: unique per process, readable in ``ZRANGE``."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class ReplicaMembership:
    """This replica's entry in the live set, and the live count.

    Args:
        client: the Redis pool.
        prefix: key prefix (the set is ``<prefix>replicas``).
        ttl_ms: an entry not refreshed for this long stops counting.
        on_count: called with every count read (the limiter's share divisor).
        timeout_s: budget of one refresh.
    """

    def __init__(
        self,
        client: RedisClient,
        *,
        prefix: str,
        ttl_ms: int,
        on_count: Callable[[int], None],
        timeout_s: float = 1.0,
    ) -> None:
        if ttl_ms <= 0:
            raise ValueError(f"ttl_ms must be > 0, got {ttl_ms}")
        self.client = client
        self.key = f"{prefix}replicas"
        self.ttl_ms = ttl_ms
        self.id = replica_id()
        self.on_count = on_count
        self.timeout_s = timeout_s
        self.count: int | None = None  # None until Redis answered once
        self._task: asyncio.Task[None] | None = None

    async def refresh(self) -> int:
        """Renew this replica's entry; return the live count (raises ``StoreError`` or
        ``TimeoutError``)."""
        with store_errors("replicas"):
            n = int(
                await asyncio.wait_for(
                    _SCRIPT(self.client, [self.key], [self.id, self.ttl_ms]), self.timeout_s
                )
            )
        self._set(n)
        return n

    def _set(self, n: int) -> None:
        if n != self.count:
            log.info("live gateway replicas", count=n, previous=self.count, replica=self.id)
        self.count = n
        metrics.LIVE_REPLICAS.set(n)
        self.on_count(n)

    def start(self) -> None:
        """Refresh every ``ttl / 3`` in the background until ``leave``."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="replica-membership")

    async def _run(self) -> None:
        period = self.ttl_ms / 3000
        while True:
            try:
                await self.refresh()
            except _FAILURES as exc:
                log.warning(
                    "replica count not refreshed; the fail-open share keeps the last count",
                    error=f"{type(exc).__name__}: {exc}",
                    count=self.count,
                )
            await asyncio.sleep(period)

    async def leave(self) -> None:
        """Stop refreshing and remove this replica's entry (best effort)."""
        await cancel_and_wait(self._task)
        self._task = None
        with contextlib.suppress(*_FAILURES), store_errors("replicas"):
            await asyncio.wait_for(_SCRIPT(self.client, [self.key], [self.id, ""]), self.timeout_s)
