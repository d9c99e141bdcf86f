"""trtllm.TrtllmService served by our engine (real model, real gRPC on loopback), driven
through smg-grpc-proto's own stubs, checked against llm.v1.Engine on the same port and
against the engine's own stats."""

from __future__ import annotations

import hashlib
from typing import Any

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2, trtllm_service_pb2, trtllm_service_pb2_grpc

from llm.v1 import engine_pb2, engine_pb2_grpc
from tests.integration.engine.conftest import wait_for_idle
from tests.integration.engine.test_standard_vllm import (
    PROMPT,
    native_tokens,
    refused_naming,
)

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def trt(channel: grpc.Channel) -> trtllm_service_pb2_grpc.TrtllmServiceStub:
    return trtllm_service_pb2_grpc.TrtllmServiceStub(channel)


def trt_request(
    rid: str, max_tokens: int, *, streaming: bool = True, **fields: Any
) -> trtllm_service_pb2.GenerateRequest:
    greedy = {"sampling_config": trtllm_service_pb2.SamplingConfig(temperature=0.0)}
    return trtllm_service_pb2.GenerateRequest(
        request_id=rid,
        tokenized=trtllm_service_pb2.TokenizedInput(input_token_ids=PROMPT),
        max_tokens=max_tokens,
        streaming=streaming,
        **{**greedy, **fields},
    )


def test_stream_matches_the_native_protocol(
    trt: trtllm_service_pb2_grpc.TrtllmServiceStub, native: engine_pb2_grpc.EngineStub
) -> None:
    req = trt_request("t-stream", 10, ignore_eos=True)
    req.output_config.logprobs = 2
    req.output_config.return_perf_metrics = True
    msgs = list(trt.Generate(req, timeout=120))
    chunks, done = msgs[:-1], msgs[-1].complete
    assert chunks
    assert all(m.request_id == "t-stream" for m in msgs)
    streamed = [t for m in chunks for t in m.chunk.token_ids]
    assert list(done.output_token_ids) == streamed == native_tokens(native, PROMPT, 10)
    assert [m.chunk.completion_tokens for m in chunks][-1] == 10  # cumulative
    assert (done.finish_reason, done.completion_tokens, done.prompt_tokens) == (
        "length",
        10,
        len(PROMPT),
    )
    assert [lp.token_id for lp in done.logprobs] == streamed
    assert all(len(lp.top_logprobs) == 2 for lp in done.logprobs)
    perf = done.perf_metrics
    assert 0 < perf.arrival_time <= perf.first_token_time <= perf.last_token_time


def test_non_streaming_sends_only_the_complete(
    trt: trtllm_service_pb2_grpc.TrtllmServiceStub,
) -> None:
    msgs = list(trt.Generate(trt_request("t-unary", 5, streaming=False), timeout=120))
    assert [m.WhichOneof("response") for m in msgs] == ["complete"]
    assert len(msgs[0].complete.output_token_ids) == msgs[0].complete.completion_tokens <= 5


def test_abort_frees_kv_blocks(
    trt: trtllm_service_pb2_grpc.TrtllmServiceStub, native: engine_pb2_grpc.EngineStub
) -> None:
    before = wait_for_idle(native)
    msgs = []
    for m in trt.Generate(trt_request("t-abort", 1500, ignore_eos=True), timeout=120):
        msgs.append(m)
        if len(msgs) == 3:
            assert native.GetStats(engine_pb2.GetStatsRequest()).num_kv_blocks_used > before
            ok = trt.Abort(trtllm_service_pb2.AbortRequest(request_id="t-abort"))
            assert ok.success
    assert msgs[-1].complete.finish_reason == "abort"
    assert wait_for_idle(native) == before


@pytest.mark.parametrize(
    ("field", "extra"),
    [
        ("bad_token_ids", {"bad_token_ids": [5]}),
        ("lora_config", {"lora_config": trtllm_service_pb2.LoraConfig(task_id=1)}),
        (
            "sampling_config.beam_width",
            {"sampling_config": trtllm_service_pb2.SamplingConfig(beam_width=2)},
        ),
        (
            "output_config.prompt_logprobs",
            {"output_config": trtllm_service_pb2.OutputConfig(prompt_logprobs=1)},
        ),
    ],
)
def test_what_the_engine_cannot_apply_is_refused_by_name(
    trt: trtllm_service_pb2_grpc.TrtllmServiceStub, field: str, extra: dict[str, Any]
) -> None:
    refused_naming(
        trt.Generate(trt_request("t-bad", 4, **extra), timeout=30), field, "does not support"
    )


def test_info_health_and_tokenizer(
    trt: trtllm_service_pb2_grpc.TrtllmServiceStub, native: engine_pb2_grpc.EngineStub
) -> None:
    ours = native.GetModelInfo(engine_pb2.GetModelInfoRequest())
    info = trt.GetModelInfo(trtllm_service_pb2.GetModelInfoRequest())
    assert (info.model_id, info.vocab_size, info.max_seq_len) == (
        ours.model,
        ours.vocab_size,
        ours.max_context_length,
    )
    assert info.num_layers > 0
    assert trt.HealthCheck(trtllm_service_pb2.HealthCheckRequest()).status == "OK"
    server = trt.GetServerInfo(trtllm_service_pb2.GetServerInfoRequest())
    assert (server.backend, server.world_size) == (ours.backend, 1)
    chunks = list(trt.GetTokenizer(common_pb2.GetTokenizerRequest()))
    data = b"".join(c.data for c in chunks)
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest()
