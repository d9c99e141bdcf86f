"""One engine replica as the gateway sees it: channel, health watch, stats, model info.

Two background tasks per replica keep its view fresh:

    health watch   grpc.health.v1 Watch stream; SERVING -> healthy. A broken
                   stream (process killed, connection refused) marks it
                   unhealthy at once; it reconnects with backoff.
    stats poll     GetStats every ``stats_interval_s``: queue, running, KV
                   usage, draining. GetModelInfo whenever it turns healthy.

A replica turns healthy only once its ModelInfo is known and its model's
tokenizer is held (``gateway.fleet.tokenizers``); until then the watch retries
with backoff.

``outstanding`` counts this gateway's calls in flight on the replica; the
breaker judges it from call outcomes (``common.breaker``).
"""

from __future__ import annotations

import asyncio
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.breaker import ORDINARY, CircuitBreaker, Ticket
from common.log import get_logger
from common.service_auth import token_metadata
from common.tasks import cancel_and_wait
from gateway import metrics
from gateway.fleet.tokenizers import TokenizerFetchError, TokenizerSet
from llm.v1 import engine_pb2, engine_pb2_grpc

log = get_logger(__name__)

CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
]


class Replica:
    """State and stubs of one engine replica.

    Args:
        address: ``host:port``.
        breaker: Its circuit breaker.
        stats_interval_s: GetStats period.
        tokenizers: Where its model's tokenizer is fetched to (None = a set of its own).
    """

    def __init__(
        self,
        address: str,
        breaker: CircuitBreaker,
        stats_interval_s: float,
        service_token: str = "",
        tokenizers: TokenizerSet | None = None,
    ) -> None:
        self.address = address
        self.tokenizers = tokenizers if tokenizers is not None else TokenizerSet()
        self.call_metadata = token_metadata(service_token)  # sent on every engine call
        self.breaker = breaker
        self.stats_interval_s = stats_interval_s
        self.channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self.stub = engine_pb2_grpc.EngineStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)
        self.healthy = False
        self.stats: engine_pb2.EngineStats | None = None
        self.info: engine_pb2.ModelInfo | None = None
        self.outstanding = 0
        self.last_pick = 0.0
        self.last_error = "not connected yet"
        self._tasks: list[asyncio.Task[None]] = []
        metrics.BREAKER_STATE.labels(address).set(0)
        metrics.HEALTHY.labels(address).set(0)
        metrics.OUTSTANDING.labels(address).set(0)

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
        await self.channel.close(None)

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
                stream = self._health.Watch(health_pb2.HealthCheckRequest(service=""))
                try:
                    async for resp in stream:
                        serving = resp.status == health_pb2.HealthCheckResponse.SERVING
                        if serving and not self.healthy and not await self._refresh_info():
                            break  # a new watch after the backoff says SERVING again
                        why = "" if serving else "health check says NOT_SERVING"
                        self._set_healthy(serving, why)
                        backoff = 0.1
                    else:
                        self._set_healthy(False, "health watch ended")
                finally:
                    stream.cancel()
            except grpc.aio.AioRpcError as e:
                self._set_healthy(False, f"unreachable ({e.code().name}: {e.details()})")
            await asyncio.sleep(backoff)
            backoff = min(2.0, backoff * 2)

    async def _refresh_info(self) -> bool:
        """ModelInfo, stats and the model's tokenizer; False (with ``last_error``) when
        one of them could not be had."""
        try:
            info = await self.stub.GetModelInfo(
                engine_pb2.GetModelInfoRequest(), timeout=5, metadata=self.call_metadata
            )
            self.stats = await self.stub.GetStats(
                engine_pb2.GetStatsRequest(), timeout=5, metadata=self.call_metadata
            )
        except grpc.aio.AioRpcError as e:
            self.last_error = f"GetModelInfo failed ({e.code().name}: {e.details()})"
            return False
        try:
            await self.tokenizers.ensure(info, self.stub, self.call_metadata, self.address)
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
            if not self.healthy:
                continue
            try:
                self.stats = await self.stub.GetStats(
                    engine_pb2.GetStatsRequest(),
                    timeout=max(1.0, self.stats_interval_s),
                    metadata=self.call_metadata,
                )
            except grpc.aio.AioRpcError as e:
                self.last_error = f"GetStats failed ({e.code().name})"
