"""One engine replica as the gateway sees it, against a fake engine on loopback gRPC:
healthy only once SERVING with its ModelInfo, stats and tokenizer known; unhealthy
(with the reason) on NOT_SERVING, when unreachable or when no tokenizer can be had;
stats polled; calls in flight counted and judged by its breaker."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common.breaker import BreakerPolicy, BreakerState, CircuitBreaker
from common.redis_server import free_port
from gateway.fleet.replica import Replica
from gateway.fleet.tokenizers import TokenizerSet
from llm.v1 import engine_pb2, engine_pb2_grpc
from tokenizer_svc.tokenizer import TextTokenizer

LOCAL_TOKENIZER: Any = object()  # the gateway's own tokenizer, never used to encode here


class FakeEngine(engine_pb2_grpc.EngineServicer):
    """The two calls a replica makes besides health: model info and stats."""

    def __init__(self) -> None:
        self.stats = engine_pb2.EngineStats()
        self.info_calls = 0

    async def GetModelInfo(
        self, request: engine_pb2.GetModelInfoRequest, context: Any
    ) -> engine_pb2.ModelInfo:
        self.info_calls += 1
        return engine_pb2.ModelInfo(model="m", version="v1", max_context_length=2048)

    async def GetStats(
        self, request: engine_pb2.GetStatsRequest, context: Any
    ) -> engine_pb2.EngineStats:
        return self.stats


class Served:
    def __init__(self, server: grpc.aio.Server, address: str, engine: FakeEngine) -> None:
        self.server = server
        self.address = address
        self.engine = engine
        self.health: Any = health.aio.HealthServicer()  # type: ignore[attr-defined]


@pytest.fixture
async def served() -> AsyncIterator[Served]:
    server = grpc.aio.server()
    port = server.add_insecure_port("127.0.0.1:0")
    engine = FakeEngine()  # type: ignore[abstract]  # the calls a replica makes are all it needs
    s = Served(server, f"127.0.0.1:{port}", engine)
    engine_pb2_grpc.add_EngineServicer_to_server(s.engine, server)
    health_pb2_grpc.add_HealthServicer_to_server(s.health, server)
    await s.health.set("", health_pb2.HealthCheckResponse.SERVING)
    await server.start()
    try:
        yield s
    finally:
        await server.stop(0)


def replica(address: str, local: TextTokenizer | None = LOCAL_TOKENIZER) -> Replica:
    breaker = CircuitBreaker(address, BreakerPolicy(consecutive_failures=2, open_s=60))
    return Replica(address, breaker, stats_interval_s=0.05, tokenizers=TokenizerSet(local))


async def until(what: str, ready: Callable[[], bool], limit_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + limit_s
    while not ready():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"gave up after {limit_s} s waiting for {what}")
        await asyncio.sleep(0.01)


async def test_healthy_once_serving_with_its_model_then_not_on_not_serving(
    served: Served,
) -> None:
    r = replica(served.address)
    assert not r.healthy
    assert r.last_error == "not connected yet"
    r.start()
    try:
        await until("the replica to turn healthy", lambda: r.healthy)
        assert r.info is not None
        assert (r.info.model, r.info.version) == ("m", "v1")
        assert r.stats is not None
        assert served.engine.info_calls == 1
        await served.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        await until("the replica to turn unhealthy", lambda: not r.healthy)
        assert r.last_error == "health check says NOT_SERVING"
        await served.health.set("", health_pb2.HealthCheckResponse.SERVING)
        await until("the replica to turn healthy again", lambda: r.healthy)
        assert served.engine.info_calls == 2  # its model is read again on the way back
    finally:
        await r.close()


async def test_stats_are_polled_and_draining_is_read_from_them(served: Served) -> None:
    r = replica(served.address)
    r.start()
    try:
        await until("the replica to turn healthy", lambda: r.healthy)
        assert not r.draining
        served.engine.stats = engine_pb2.EngineStats(num_waiting=7, draining=True)
        await until("the next stats poll", lambda: r.stats is not None and r.stats.num_waiting == 7)
        assert r.draining
    finally:
        await r.close()


async def test_no_tokenizer_for_its_model_keeps_it_unroutable(served: Served) -> None:
    r = replica(served.address, local=None)  # the engine serves none, the gateway has none
    r.start()
    try:
        await until("the reason", lambda: "serves no tokenizer" in r.last_error)
        assert not r.healthy
        assert r.info is None
    finally:
        await r.close()


async def test_an_unreachable_replica_is_unhealthy_with_the_reason() -> None:
    r = replica(f"127.0.0.1:{free_port()}")  # nothing listens there
    r.start()
    try:
        await until("the reason", lambda: r.last_error.startswith("unreachable (UNAVAILABLE"))
        assert not r.healthy
    finally:
        await r.close()


async def test_calls_in_flight_are_counted_and_judged_by_its_breaker() -> None:
    r = replica("127.0.0.1:1")  # never started: no call goes out
    try:
        for _ in range(3):
            r.acquire()
        assert r.outstanding == 3
        assert r.last_pick > 0
        r.release(None)  # neutral: the breaker does not count it
        r.release(False)
        after_one = r.breaker.state
        r.release(False)  # the second failure in a row opens it
        assert r.outstanding == 0
        assert (after_one, r.breaker.state) == (BreakerState.CLOSED, BreakerState.OPEN)
    finally:
        await r.close()
