"""sglang.grpc.scheduler.SglangScheduler served by our engine (real model, real gRPC on
loopback), driven through smg-grpc-proto's own stubs and checked against llm.v1.Engine
on the same port and the engine's own stats."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from smg_grpc_proto.generated import (
    sglang_scheduler_pb2 as pb,
)
from smg_grpc_proto.generated import (
    sglang_scheduler_pb2_grpc as pb_grpc,
)

from engine_svc.standard.sglang_scheduler import PROTOCOL
from llm.v1 import engine_pb2, engine_pb2_grpc
from tests.integration.engine.conftest import wait_for_idle
from tests.integration.engine.test_standard_vllm import (
    PROMPT,
    native_tokens,
    refused_naming,
)

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def sgl(channel: grpc.Channel) -> pb_grpc.SglangSchedulerStub:
    return pb_grpc.SglangSchedulerStub(channel)


def sgl_request(rid: str, max_new_tokens: int, **fields: Any) -> pb.GenerateRequest:
    sampling: dict[str, Any] = {"temperature": 0.0, "max_new_tokens": max_new_tokens, "top_k": -1}
    extra = {k: v for k, v in fields.items() if k in pb.GenerateRequest.DESCRIPTOR.fields_by_name}
    sampling.update({k: v for k, v in fields.items() if k not in extra})
    return pb.GenerateRequest(
        request_id=rid,
        tokenized=pb.TokenizedInput(input_ids=PROMPT),
        sampling_params=pb.SamplingParams(**sampling),
        stream=True,
        **extra,
    )


def test_stream_matches_the_native_protocol_with_cumulative_counts(
    sgl: pb_grpc.SglangSchedulerStub, native: engine_pb2_grpc.EngineStub
) -> None:
    msgs = list(sgl.Generate(sgl_request("s-stream", 10, ignore_eos=True), timeout=120))
    chunks, done = [m.chunk for m in msgs[:-1]], msgs[-1].complete
    streamed = [t for c in chunks for t in c.token_ids]
    assert list(done.output_ids) == streamed == native_tokens(native, PROMPT, 10)
    counts = [c.completion_tokens for c in chunks]
    assert counts == sorted(counts)
    assert counts[-1] == 10  # cumulative, as the proto says
    assert (done.finish_reason, done.prompt_tokens, done.completion_tokens) == (
        "length",
        len(PROMPT),
        10,
    )


def test_logprobs_when_asked(sgl: pb_grpc.SglangSchedulerStub) -> None:
    req = sgl_request("s-lp", 3, return_logprob=True, top_logprobs_num=2, logprob_start_len=-1)
    done = list(sgl.Generate(req, timeout=120))[-1].complete
    lp = done.output_logprobs
    assert list(lp.token_ids) == list(done.output_ids)
    assert [t.token_ids[0] for t in lp.top_logprobs] == list(done.output_ids)  # greedy
    assert all(len(t.values) == 2 for t in lp.top_logprobs)


def test_abort_by_id_frees_kv_blocks(
    sgl: pb_grpc.SglangSchedulerStub, native: engine_pb2_grpc.EngineStub
) -> None:
    before = wait_for_idle(native)
    call = sgl.Generate(sgl_request("s-abort", 1500, ignore_eos=True), timeout=120)
    msgs = []
    for m in call:
        msgs.append(m)
        if len(msgs) == 3:
            assert native.GetStats(engine_pb2.GetStatsRequest()).num_kv_blocks_used > before
            assert sgl.Abort(pb.AbortRequest(request_id="s-abort")).success
    assert msgs[-1].complete.finish_reason == "abort"
    assert wait_for_idle(native) == before


@pytest.mark.parametrize(
    ("field", "fields"),
    [
        ("sampling_params.n", {"n": 2}),
        ("sampling_params.logit_bias", {"logit_bias": {"5": 1.0}}),
        ("lora_id", {"lora_id": "adapter"}),
        ("logprob_start_len", {"return_logprob": True, "logprob_start_len": 0}),
        ("return_hidden_states", {"return_hidden_states": True}),
    ],
)
def test_what_the_engine_cannot_apply_is_refused_by_name(
    sgl: pb_grpc.SglangSchedulerStub, field: str, fields: dict[str, Any]
) -> None:
    refused_naming(sgl.Generate(sgl_request("s-bad", 4, **fields), timeout=30), field, PROTOCOL)


def test_info_health_loads_and_lora(
    sgl: pb_grpc.SglangSchedulerStub, native: engine_pb2_grpc.EngineStub
) -> None:
    info = sgl.GetModelInfo(pb.GetModelInfoRequest())
    ours = native.GetModelInfo(engine_pb2.GetModelInfoRequest())
    assert info.served_model_name == ours.model
    assert list(info.eos_token_ids) == list(ours.eos_token_ids)
    assert sgl.HealthCheck(pb.HealthCheckRequest()).healthy
    stats = native.GetStats(engine_pb2.GetStatsRequest())
    server = sgl.GetServerInfo(pb.GetServerInfoRequest())
    assert server.max_total_num_tokens == stats.num_kv_blocks_total * ours.kv_block_size
    load = sgl.GetLoads(pb.GetLoadsRequest()).loads[0]
    assert load.max_running_requests == stats.max_num_seqs
    assert not sgl.ListLoadedLoRAAdapters(pb.ListLoadedLoRAAdaptersRequest()).loaded_adapters
    with pytest.raises(grpc.RpcError) as err:
        sgl.LoadLoRAAdapter(pb.LoadLoRAAdapterRequest(lora_name="x", lora_path="/x"))
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
