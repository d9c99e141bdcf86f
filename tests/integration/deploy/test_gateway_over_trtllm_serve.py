"""The gateway in front of TensorRT-LLM's stock ``trtllm-serve <model> --grpc``
(TrtllmService), the server already running: deploy/gpu-check.sh starts it on a
GPU and sets LLM_STOCK_TRTLLM_ADDRESS (host:port) and LLM_STOCK_TRTLLM_OPTIONS
(the options file deploy/trtllm_options.py rendered for it).

Without LLM_STOCK_TRTLLM_ADDRESS these tests skip (no GPU and no TensorRT-LLM
wheel for this machine); LLM_REQUIRE_STOCK_TRTLLM=1 turns the skip into a
failure, so the GPU check cannot pass by not running them.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import yaml
from smg_grpc_proto.generated import trtllm_service_pb2, trtllm_service_pb2_grpc

from common.procs import ManagedProcess
from common.redis_server import RedisServer
from llm.v1 import common_pb2
from tests.integration.gateway.conftest import GatewayProcess, chat, start_gateway

pytestmark = [pytest.mark.integration, pytest.mark.stock_engine]


@pytest.fixture(scope="module")
def trtllm_address() -> str:
    address = os.environ.get("LLM_STOCK_TRTLLM_ADDRESS", "")
    if not address:
        reason = "no trtllm-serve --grpc running (deploy/gpu-check.sh starts one on a GPU)"
        if os.environ.get("LLM_REQUIRE_STOCK_TRTLLM") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    return address


@pytest.fixture(scope="module")
def gw_trtllm(
    trtllm_address: str,
    model_dir: Path,
    tokenizer_server: ManagedProcess,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[GatewayProcess]:
    redis = RedisServer().start()
    gw = start_gateway(
        "gw-trtllm",
        [f"trtllm://{trtllm_address}?model={model_dir.name}"],
        tokenizer_server.address,
        redis.url,
        tmp_path_factory.mktemp("gw-trtllm"),
    )
    try:
        yield gw
    finally:
        gw.stop()
        redis.close()


def test_the_server_runs_the_rendered_parallelism(trtllm_address: str) -> None:
    """TrtllmService's own GetServerInfo against the options file it was given."""
    with grpc.insecure_channel(trtllm_address) as ch:
        info = trtllm_service_pb2_grpc.TrtllmServiceStub(ch).GetServerInfo(
            trtllm_service_pb2.GetServerInfoRequest(), timeout=10
        )
    options_path = os.environ.get("LLM_STOCK_TRTLLM_OPTIONS", "")
    if options_path:
        options = yaml.safe_load(Path(options_path).read_text())
        assert info.tensor_parallel_size == options["tensor_parallel_size"]
        assert info.pipeline_parallel_size == options["pipeline_parallel_size"]
    assert info.world_size >= 1


def test_streams_a_chat_completion_with_usage(gw_trtllm: GatewayProcess) -> None:
    _, key = gw_trtllm.tenant()
    chunks = gw_trtllm.generate(key, chat("What is the capital of France?", max_tokens=12))
    ids = [t for c in chunks for t in c.token_ids]
    last = chunks[-1]
    assert "".join(c.text for c in chunks).strip()
    assert last.finish_reason in (common_pb2.STOP, common_pb2.LENGTH)
    assert last.usage.completion_tokens == len(ids)
    assert 0 < last.usage.completion_tokens <= 12
    assert last.usage.prompt_tokens > 5


def test_greedy_is_repeatable_and_max_tokens_is_exact(gw_trtllm: GatewayProcess) -> None:
    _, key = gw_trtllm.tenant()
    req = chat("Count from one to twenty in words.", max_tokens=16, temperature=0.0)
    req.sampling.ignore_eos = True
    a = gw_trtllm.generate(key, req)
    b = gw_trtllm.generate(key, req)
    assert [t for c in a for t in c.token_ids] == [t for c in b for t in c.token_ids]
    assert a[-1].finish_reason == common_pb2.LENGTH
    assert a[-1].usage.completion_tokens == 16


def test_a_cancelled_stream_returns_its_lease(gw_trtllm: GatewayProcess) -> None:
    _, key = gw_trtllm.tenant(max_concurrent=1)
    req = chat("Write a very long essay about the sea.", max_tokens=200)
    req.sampling.ignore_eos = True
    call = gw_trtllm.stub.Generate(req, metadata=(("authorization", f"Bearer {key}"),), timeout=60)
    next(iter(call))  # running on the engine
    call.cancel()  # type: ignore[no-untyped-call]
    # the one lease comes back: a bounded number of tries, not a timing assertion
    for _ in range(100):
        try:
            done = gw_trtllm.generate(key, chat("hi", max_tokens=2))
            break
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise
            time.sleep(0.1)
    else:
        pytest.fail("the cancelled stream's lease never came back")
    assert done[-1].usage.completion_tokens <= 2
