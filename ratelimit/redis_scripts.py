"""Lua scripts in Redis: loaded once, called by EVALSHA, reloaded on NOSCRIPT, batched.

The caller side every Redis-backed part of ``ratelimit`` shares (the limiter's
scripts in ``ratelimit.limiter.lua``, the budget ledger's in
``ratelimit.budget.ledger``).
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
from collections.abc import Sequence
from typing import Any

from redis.asyncio.cluster import RedisCluster
from redis.exceptions import NoScriptError

from ratelimit import metrics
from ratelimit.redis_client import RedisClient, store_errors


class LuaScript:
    """A script loaded once per server and called by EVALSHA.

    ``SCRIPT LOAD`` runs at start-up (``load``); if Redis forgets the script
    (restart, failover, ``SCRIPT FLUSH``) the NOSCRIPT reply triggers one
    reload and one retry, so recovery needs no restart of the caller.
    """

    def __init__(self, name: str, source: str) -> None:
        self.name = name
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()
        self.num_reloads = 0

    async def load(self, client: RedisClient) -> None:
        """Load the script into the server's script cache."""
        sha = await client.script_load(self.source)
        if sha != self.sha:
            raise RuntimeError(f"script {self.name}: server sha {sha} != local {self.sha}")

    async def __call__(self, client: RedisClient, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """Run the script; reload it once if the server lost it."""
        try:
            return await client.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            self.num_reloads += 1
            await self.load(client)
            return await client.evalsha(self.sha, len(keys), *keys, *args)


async def load_scripts(client: RedisClient, scripts: Sequence[LuaScript]) -> None:
    """Load ``scripts`` (start-up); raises ``StoreError`` if Redis is down."""
    with store_errors("script load"):
        for script in scripts:
            await script.load(client)


async def run_script(
    client: RedisClient, script: LuaScript, keys: Sequence[str], args: Sequence[Any]
) -> Any:
    """Run ``script``; a Redis failure surfaces as ``StoreError``."""
    with store_errors(script.name):
        return await script(client, keys, args)


_Call = tuple[LuaScript, Sequence[str], Sequence[Any], "asyncio.Future[Any]"]


class ScriptBatcher:
    """Script calls to one Redis server, coalesced while one is in flight.

    A call made when nothing is in flight goes out at once, alone (no added
    latency at low load). Calls made while a round trip is in flight queue up
    and go out together, as one pipeline (one write, one read), as soon as it
    ends, so under load N admissions and settlements cost one round trip and
    one wake-up of Redis and of this process instead of N. Each call still runs
    its own script atomically; a pipeline is not a transaction. A caller that
    stops waiting (cancelled, timed out) does not take its call back, exactly as
    with a call already written to the socket.

    For a Redis Cluster the calls go one by one (``batching`` False): its
    pipelines split by slot and node, which gains little for one tenant's keys.

    A batch gets ``timeout_s`` (the callers' own budget): past it each caller has
    given up, and a pipeline cut short is not resent (a script that ran must not run
    twice), so the next batch goes out at once.

    Args:
        client: The Redis client.
        max_batch: Most calls in one pipeline.
        timeout_s: Longest one batch may take (None = no bound).
    """

    def __init__(
        self, client: RedisClient, max_batch: int = 128, timeout_s: float | None = None
    ) -> None:
        self.client = client
        self.max_batch = max_batch
        self.timeout_s = timeout_s
        self._drainer: asyncio.Task[None] | None = None
        self.batching = not isinstance(client, RedisCluster)
        self._queue: collections.deque[_Call] = collections.deque()
        self._busy = False
        self.num_round_trips = 0
        self.num_calls = 0

    async def __call__(self, script: LuaScript, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """Run ``script`` (raises what the call raised; the caller maps store errors)."""
        self.num_calls += 1
        metrics.SCRIPT_CALLS.inc()
        if self.batching and self._busy:
            future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            self._queue.append((script, keys, args, future))
            return await future
        self._busy = self.batching  # the calls made while this one runs queue behind it
        try:
            self._round_trip()
            return await script(self.client, keys, args)
        finally:
            if self.batching:
                self._release()

    def _round_trip(self) -> None:
        self.num_round_trips += 1
        metrics.SCRIPT_ROUND_TRIPS.inc()

    def _release(self) -> None:
        if self._queue:
            self._drainer = asyncio.get_running_loop().create_task(
                self._drain(), name="redis-script-batch"
            )
        else:
            self._busy = False

    async def _drain(self) -> None:
        """Send what queued while busy, batch after batch, until nothing waits."""
        try:
            while self._queue:
                batch = [
                    self._queue.popleft() for _ in range(min(self.max_batch, len(self._queue)))
                ]
                self._round_trip()
                await self._send(batch)
        finally:
            self._busy = False

    async def _send(self, batch: list[_Call]) -> None:
        results: list[Any] = []
        try:
            async with asyncio.timeout(self.timeout_s):
                async with self.client.pipeline(transaction=False) as pipe:
                    for script, keys, args, _ in batch:
                        pipe.evalsha(script.sha, len(keys), *keys, *args)
                    results = await pipe.execute(raise_on_error=False)
                for i, ((script, keys, args, _), result) in enumerate(
                    zip(batch, results, strict=True)
                ):
                    if isinstance(result, NoScriptError):  # Redis lost it: reload, run alone
                        try:
                            results[i] = await script(self.client, keys, args)
                        except Exception as exc:
                            results[i] = exc
        except BaseException as exc:  # the connection failed or the time ran out: the
            for *_, future in batch:  # outcome of every call is unknown to its caller
                if not future.done():
                    future.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
            return
        for (*_, future), result in zip(batch, results, strict=True):
            if future.done():  # its caller stopped waiting
                continue
            if isinstance(result, Exception):
                future.set_exception(result)
            else:
                future.set_result(result)
