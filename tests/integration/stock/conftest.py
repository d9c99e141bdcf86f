"""A stock vLLM gRPC server (vLLM's own launcher and smg-grpc-servicer, from vLLM's
venv) beside one native engine, and gateways over them.

Without vLLM's venv these tests skip, naming ``make vllm-venv``; ``make test-vllm``
sets LLM_REQUIRE_STOCK_VLLM=1, which turns that skip into a failure (CI must not
pass by not running them).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2, vllm_engine_pb2_grpc

from common.procs import ManagedProcess
from common.redis_server import RedisServer
from deploy.stock_vllm import StockVllm, vllm_python
from tests.conftest import start_engine
from tests.integration.gateway.conftest import GatewayProcess, free_port, start_gateway

pytestmark = [pytest.mark.integration, pytest.mark.stock_engine]

VLLM_VERSION = "vllm-canary"


def wait_until(fn: Callable[[], bool], timeout: float = 30.0, what: str = "condition") -> None:
    """Poll ``fn`` until it holds; a bound on waiting, not a speed assertion."""
    deadline = time.monotonic() + timeout
    while not fn():
        assert time.monotonic() < deadline, f"{what} not reached in {timeout:.0f}s"
        time.sleep(0.1)


def vllm_load(address: str) -> vllm_engine_pb2.SchedulerLoad:
    """The stock engine's own account of what it holds (GetLoads, rank 0)."""
    with grpc.insecure_channel(address) as ch:
        resp = vllm_engine_pb2_grpc.VllmEngineStub(ch).GetLoads(
            vllm_engine_pb2.GetLoadsRequest(), timeout=5
        )
    load: vllm_engine_pb2.SchedulerLoad = resp.loads[0]
    return load


@pytest.fixture(scope="session")
def stock_vllm(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[StockVllm]:
    if vllm_python() is None:
        reason = "no vLLM venv: `make vllm-venv` builds it (make test-vllm runs these tests)"
        if os.environ.get("LLM_REQUIRE_STOCK_VLLM") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    server = StockVllm(model_dir, port=free_port(), log_dir=tmp_path_factory.mktemp("stock-vllm"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def native_engine(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ManagedProcess]:
    proc = start_engine("stock-native", model_dir, tmp_path_factory.mktemp("stock-native"))
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="session")
def stock_redis() -> Iterator[RedisServer]:
    server = RedisServer().start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="session")
def gw_vllm(
    stock_vllm: StockVllm,
    tokenizer_server: ManagedProcess,
    stock_redis: RedisServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[GatewayProcess]:
    """A gateway whose only engine is the stock vLLM server."""
    gw = start_gateway(
        "gw-vllm",
        [f"vllm://{stock_vllm.address}"],
        tokenizer_server.address,
        stock_redis.url,
        tmp_path_factory.mktemp("gw-vllm"),
    )
    try:
        yield gw
    finally:
        gw.stop()


@pytest.fixture(scope="session")
def gw_mixed(
    stock_vllm: StockVllm,
    native_engine: ManagedProcess,
    tokenizer_server: ManagedProcess,
    stock_redis: RedisServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[GatewayProcess]:
    """A gateway over a native replica and a stock vLLM replica of the same model, the
    vLLM one as version ``VLLM_VERSION`` (the protocol carries none of its own)."""
    gw = start_gateway(
        "gw-mixed",
        [native_engine.address, f"vllm://{stock_vllm.address}?version={VLLM_VERSION}"],
        tokenizer_server.address,
        stock_redis.url,
        tmp_path_factory.mktemp("gw-mixed"),
        env={"LLM_GATEWAY_FAILOVER": "true"},
    )
    try:
        yield gw
    finally:
        gw.stop()
