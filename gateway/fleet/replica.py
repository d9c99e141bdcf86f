"""One engine replica as the gateway sees it: its client, health watch, stats, model info.

The replica speaks to its engine through an engine client (``gateway.fleet.engine_client``:
llm.v1, VllmEngine or TrtllmService, as its entry says), always in llm.v1 terms. Two
background tasks per replica keep its view fresh:

    health watch   the client's health answers (llm.v1: the grpc.health.v1 Watch
                   stream; a standard protocol: its HealthCheck polled); serving ->
                   healthy. A broken stream or failed poll (process killed,
                   connection refused) marks it unhealthy at once; it reconnects
                   with backoff.
    stats poll     the client's stats every ``stats_interval_s``: queue, running, KV
                   usage, draining. Model info whenever it turns healthy.

A replica turns healthy only once its ModelInfo is known and its model's
tokenizer is held (``gateway.fleet.tokenizers``); until then the watch retries
with backoff.

``outstanding`` counts this gateway's calls in flight on the replica; the
breaker judges it from call outcomes (``common.breaker``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import grpc

from common.breaker import ORDINARY, CircuitBreaker, Ticket
from common.log import get_logger
from common.tasks import cancel_and_wait
from gateway import metrics
from gateway.config import EngineEntry, parse_engine_entry
from gateway.fleet.engine_client import ChannelSecurity, EngineClient, connect
from gateway.fleet.tokenizers import TokenizerFetchError, TokenizerSet
from llm.v1 import engine_pb2

log = get_logger(__name__)


class Replica:
    """State and engine client of one engine replica.

    Args:
        entry: Its engine entry (``[protocol://]host:port``, parsed or not).
        breaker: Its circuit breaker.
        stats_interval_s: Stats period (and a standard protocol's health poll).
        service_token: Sent on every engine call ("" = none).
        tokenizers: Where its model's tokenizer is fetched to (None = a set of its own).
        security: Plaintext, TLS or mutual TLS engine channels.
        client: Its engine client (None = the one its entry names).
    """

    def __init__(
        self,
        entry: str | EngineEntry,
        breaker: CircuitBreaker,
        stats_interval_s: float,
        service_token: str = "",
        tokenizers: TokenizerSet | None = None,
        security: ChannelSecurity | None = None,
        client: EngineClient | None = None,
    ) -> None:
        parsed = parse_engine_entry(entry) if isinstance(entry, str) else entry
        self.address = str(parsed)
        self.tokenizers = tokenizers if tokenizers is not None else TokenizerSet()
        self.breaker = breaker
        self.stats_interval_s = stats_interval_s
        self.client = client or connect(parsed, service_token, security, stats_interval_s)
        self.healthy = False
        self.stats: engine_pb2.EngineStats | None = None
        self.info: engine_pb2.ModelInfo | None = None
        self.outstanding = 0
        self.last_pick = 0.0
        self.last_error = "not connected yet"
        self._tasks: list[asyncio.Task[None]] = []
        metrics.BREAKER_STATE.labels(self.address).set(0)
        metrics.HEALTHY.labels(self.address).set(0)
        metrics.OUTSTANDING.labels(self.address).set(0)

    @property
    def draining(self) -> bool:
        """True when the replica said it is draining (it answers UNAVAILABLE to new work)."""
        return bool(self.stats is not None and self.stats.draining)

    def start(self) -> None:
        """Start the health watch and the stats poll."""
        self._tasks = [
            asyncio.create_task(self._watch_health(), name=f"health-{self.address}"),
            asyncio.create_task(self._poll_stats(), name=f"stats-{self.address}"),
        ]

    async def close(self) -> None:
        """Stop the background tasks and close the channel."""
        await cancel_and_wait(*self._tasks)
        await self.client.close()

    def acquire(self) -> None:
        """Count one call in flight (the breaker already admitted it)."""
        self.outstanding += 1
        self.last_pick = time.monotonic()
        metrics.OUTSTANDING.labels(self.address).set(self.outstanding)

    def release(self, verdict: bool | None, ticket: Ticket = ORDINARY) -> None:
        """End one call: True success, False failure, None neutral (for the breaker),
        with the ticket its admission got."""
        self.outstanding -= 1
        metrics.OUTSTANDING.labels(self.address).set(self.outstanding)
        self.breaker.record(verdict, ticket)

    def _set_healthy(self, healthy: bool, why: str = "") -> None:
        if healthy != self.healthy:
            log.info(
                "engine replica health changed", replica=self.address, healthy=healthy, reason=why
            )
        self.healthy = healthy
        if why:
            self.last_error = why
        metrics.HEALTHY.labels(self.address).set(int(healthy))

    async def _watch_health(self) -> None:
        backoff = 0.1
        while True:
            try:
                async with contextlib.aclosing(self.client.watch_health()) as answers:
                    async for why in answers:
                        serving = not why
                        if serving and not self.healthy and not await self._refresh_info():
                            break  # a new watch after the backoff says SERVING again
                        self._set_healthy(serving, why)
                        backoff = 0.1
                    else:
                        self._set_healthy(False, "health watch ended")
            except grpc.aio.AioRpcError as e:
                self._set_healthy(False, f"unreachable ({e.code().name}: {e.details()})")
            await asyncio.sleep(backoff)
            backoff = min(2.0, backoff * 2)

    async def _refresh_info(self) -> bool:
        """ModelInfo, stats and the model's tokenizer; False (with ``last_error``) when
        one of them could not be had."""
        try:
            info = await self.client.model_info(timeout_s=5)
            self.stats = await self.client.stats(timeout_s=5)
        except grpc.aio.AioRpcError as e:
            self.last_error = f"GetModelInfo failed ({e.code().name}: {e.details()})"
            return False
        try:
            await self.tokenizers.ensure(info, self.client, self.address)
        except TokenizerFetchError as e:
            self.last_error = str(e)
            log.warning("engine replica not routable", replica=self.address, reason=str(e))
            return False
        self.info = info
        return True

    async def _poll_stats(self) -> None:
        while True:
            await asyncio.sleep(self.stats_interval_s)
            metrics.BREAKER_STATE.labels(self.address).set(int(self.breaker.state))
            metrics.PREFIX_INDEX_BLOCKS.labels(self.address).set(self.client.prefix_blocks())
            if not self.healthy:
                continue
            try:
                self.stats = await self.client.stats(timeout_s=max(1.0, self.stats_interval_s))
            except grpc.aio.AioRpcError as e:
                self.last_error = f"GetStats failed ({e.code().name})"
