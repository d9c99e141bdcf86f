"""The versioned gateway the tests of model versions share, and their helpers.

Replicas behind the gateway of this package (one gateway for its test files):

    the suite's EnginePair          version = the default (sha-<weights>)   "stable"
    gw-canary (real engine)         --model-version v2-canary               the candidate
    FailingEngine (this conftest)     version broken-canary-test-fixture      TEST FIXTURE:
                                    an in-process Engine that answers every Generate
                                    with UNAVAILABLE (a canary that cannot serve)

The gateway uses its own Redis key prefix, so its policies, tenants and audit
log are its own. Every test sets the policy it needs.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health, health_pb2_grpc

from common.procs import ManagedProcess
from common.redis_server import RedisServer
from llm.v1 import admin_pb2, admin_pb2_grpc, engine_pb2, engine_pb2_grpc, gateway_pb2
from tests.conftest import engine_running
from tests.integration.gateway.conftest import (
    EnginePair,
    GatewayProcess,
    chat,
    start_gateway,
)

CANARY = "v2-canary"
BROKEN = "broken-canary-test-fixture"


class FailingEngine(engine_pb2_grpc.EngineServicer):
    """TEST FIXTURE: an engine replica configured to fail every Generate (UNAVAILABLE)."""

    def __init__(self, info: engine_pb2.ModelInfo) -> None:
        self.info = info
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        engine_pb2_grpc.add_EngineServicer_to_server(self, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), self.server)
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.num_generate = 0

    def GetModelInfo(self, request: Any, context: Any) -> engine_pb2.ModelInfo:
        return self.info

    def GetStats(self, request: Any, context: Any) -> engine_pb2.EngineStats:
        return engine_pb2.EngineStats()

    def GetTokenizer(self, request: Any, context: Any) -> Iterator[Any]:
        # its tokenizer is the stable engines' (same digest): the gateway holds it already
        context.abort(grpc.StatusCode.UNAVAILABLE, "test fixture: configured to fail")
        yield engine_pb2.TokenizerFilePiece()  # pragma: no cover

    def Generate(self, request: Any, context: Any) -> Iterator[Any]:
        self.num_generate += 1
        context.abort(grpc.StatusCode.UNAVAILABLE, "test fixture: configured to fail")
        yield engine_pb2.EngineGenerateResponse()  # pragma: no cover


def wait_for(what: str, check: Callable[[], bool], within_s: float = 30.0) -> None:
    end = time.monotonic() + within_s
    while not check():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


@pytest.fixture(scope="package")
def stable_info(engines: EnginePair) -> engine_pb2.ModelInfo:
    engines.ensure_running()
    with grpc.insecure_channel(engines.addresses[0]) as ch:
        info: engine_pb2.ModelInfo = engine_pb2_grpc.EngineStub(ch).GetModelInfo(
            engine_pb2.GetModelInfoRequest(), timeout=10
        )
    return info


@pytest.fixture(scope="package")
def canary_engine(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ManagedProcess]:
    with engine_running(
        "gw-canary",
        model_dir,
        tmp_path_factory.mktemp("gw-canary"),
        args=["--model-version", CANARY],
    ) as proc:
        yield proc


@pytest.fixture(scope="package")
def broken_engine(stable_info: engine_pb2.ModelInfo) -> Iterator[FailingEngine]:
    info = engine_pb2.ModelInfo()
    info.CopyFrom(stable_info)
    info.version = BROKEN
    fake = FailingEngine(info)
    fake.server.start()
    try:
        yield fake
    finally:
        fake.server.stop(None)


@pytest.fixture(scope="package")
def vgw(
    engines: EnginePair,
    stable_info: engine_pb2.ModelInfo,
    canary_engine: ManagedProcess,
    broken_engine: FailingEngine,
    tokenizer_server: ManagedProcess,
    gw_redis: RedisServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[GatewayProcess]:
    seeded = {
        stable_info.model: {
            "stable_version": stable_info.version,
            "weights": {stable_info.version: 100},
        }
    }
    env = {
        "LLM_RATELIMIT_KEY_PREFIX": "rv:",
        "LLM_GATEWAY_ROUTING_POLICY_CACHE_MS": "100",
        "LLM_GATEWAY_GUARD_INTERVAL_S": "0.2",
        "LLM_GATEWAY_RETRY_BUDGET_MIN": "50",
        "LLM_GATEWAY_ROUTING_POLICIES": json.dumps(seeded),
    }
    gw = start_gateway(
        "gateway-versions",
        [*engines.addresses, canary_engine.address, broken_engine.address],
        tokenizer_server.address,
        gw_redis.url,
        tmp_path_factory.mktemp("gateway-versions"),
        env,
    )
    try:
        yield gw
    finally:
        gw.stop()


@pytest.fixture(scope="package")
def routing(vgw: GatewayProcess) -> admin_pb2_grpc.RoutingAdminStub:
    return admin_pb2_grpc.RoutingAdminStub(vgw.channel)


@pytest.fixture(scope="package")
def model(vgw: GatewayProcess, stable_info: engine_pb2.ModelInfo) -> str:
    _, key = vgw.tenant()

    def all_healthy() -> bool:
        cards = vgw.stub.ListModels(
            gateway_pb2.ListModelsRequest(), metadata=(("authorization", f"Bearer {key}"),)
        )
        return sum(v.num_healthy_replicas for c in cards.models for v in c.versions) == 4

    wait_for("4 healthy replicas", all_healthy)
    return stable_info.model


def set_policy(
    vgw: GatewayProcess, routing: admin_pb2_grpc.RoutingAdminStub, policy: admin_pb2.RoutingPolicy
) -> admin_pb2.RoutingPolicy:
    out: admin_pb2.RoutingPolicy = routing.SetRoutingPolicy(policy, metadata=vgw.admin_md)
    return out


def served_version(
    vgw: GatewayProcess, key: str, session: str = "", req: gateway_pb2.GenerateRequest | None = None
) -> str:
    md = (("x-session-id", session),) if session else ()
    chunks = vgw.generate(key, req or chat("Hi", max_tokens=2), metadata=md)
    assert chunks[-1].finish_reason != 0
    return chunks[0].model_version
