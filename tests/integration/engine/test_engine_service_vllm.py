"""The engine service over gRPC with backend vllm: the same API, checks and clean-up as
with the native engine. Runs where vLLM is installed (``make test-vllm`` runs it in
vLLM's venv); elsewhere it is skipped with that reason."""

from __future__ import annotations

import importlib.util
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from common.procs import ManagedProcess
from llm.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from tests.conftest import start_engine

pytestmark = [pytest.mark.integration, pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vLLM is not installed here; make test-vllm runs this in vLLM's venv")]


@pytest.fixture(scope="module")
def vllm_engine(model_dir: Path, tmp_path_factory: pytest.TempPathFactory
                ) -> Iterator[ManagedProcess]:
    proc = start_engine(
        "engine-vllm", model_dir, tmp_path_factory.mktemp("engine-vllm"),
        args=["--backend", "vllm"],
        env={"LLM_ENGINE_VLLM_ENFORCE_EAGER": "true", "LLM_ENGINE_WARMUP": "false",
             "LLM_ENGINE_CORE_DTYPE": "float32", "LLM_ENGINE_CORE_MAX_MODEL_LEN": "1024",
             "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"},
        timeout=600)
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def stub(vllm_engine: ManagedProcess) -> Iterator[engine_pb2_grpc.EngineStub]:
    with grpc.insecure_channel(vllm_engine.address) as ch:
        yield engine_pb2_grpc.EngineStub(ch)


def request(rid: str, ids: list[int], max_tokens: int) -> engine_pb2.EngineGenerateRequest:
    return engine_pb2.EngineGenerateRequest(
        request_id=rid, prompt_token_ids=ids,
        sampling=engine_pb2.EngineSamplingParams(max_tokens=max_tokens, ignore_eos=True))


def test_generates_and_describes_itself(stub: engine_pb2_grpc.EngineStub) -> None:
    info = stub.GetModelInfo(engine_pb2.GetModelInfoRequest())
    assert info.backend == "vllm"
    chunks = list(stub.Generate(request("v-1", [1, 2, 3, 4, 5], 8), timeout=120))
    assert sum(len(c.token_ids) for c in chunks) == 8
    assert chunks[-1].finish_reason == common_pb2.LENGTH
    assert all(0 <= t < info.vocab_size for c in chunks for t in c.token_ids)


def test_bad_input_is_refused_before_vllm_sees_it(stub: engine_pb2_grpc.EngineStub) -> None:
    vocab = stub.GetModelInfo(engine_pb2.GetModelInfoRequest()).vocab_size
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(request("v-bad", [1, vocab + 5], 4), timeout=60))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "outside the vocabulary" in (err.value.details() or "")
    # vLLM is still alive afterwards
    assert list(stub.Generate(request("v-after", [1, 2, 3], 2), timeout=120))


def test_cancel_mid_stream_leaves_nothing_running(stub: engine_pb2_grpc.EngineStub,
                                                  vllm_engine: ManagedProcess) -> None:
    call = stub.Generate(request("v-cancel", [1, 2, 3, 4], 500), timeout=120)
    next(iter(call))
    call.cancel()  # type: ignore[no-untyped-call]
    deadline = time.monotonic() + 60
    while True:
        s = stub.GetStats(engine_pb2.GetStatsRequest())
        if s.num_running == 0 and s.num_waiting == 0:
            break
        assert time.monotonic() < deadline, "vLLM still runs the cancelled request"
        time.sleep(0.2)
    url = f"http://127.0.0.1:{vllm_engine.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as r:
        body = r.read().decode()
    assert "vllm:num_requests_running{" in body
    assert 'engine_model_info{backend="vllm"' in body
