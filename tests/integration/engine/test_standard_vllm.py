"""vllm.grpc.engine.VllmEngine served by our engine (real model, real gRPC on loopback),
driven through smg-grpc-proto's own stubs, checked against llm.v1.Engine on the same
port and against the engine's own stats."""

from __future__ import annotations

import hashlib
import io
import time
import zipfile
from pathlib import Path

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2, vllm_engine_pb2_grpc

from llm.v1 import engine_pb2, engine_pb2_grpc
from tests.integration.engine.conftest import wait_for_idle
from tokenizer_svc.chat_template import Message
from tokenizer_svc.tokenizer import TextTokenizer

pytestmark = pytest.mark.integration

PROMPT = [1, 504, 3458, 282, 4649, 314]


@pytest.fixture(scope="module")
def vllm(channel: grpc.Channel) -> vllm_engine_pb2_grpc.VllmEngineStub:
    return vllm_engine_pb2_grpc.VllmEngineStub(channel)


def vllm_request(
    rid: str, ids: list[int], max_tokens: int | None, *, stream: bool = True, **sampling: object
) -> vllm_engine_pb2.GenerateRequest:
    params = vllm_engine_pb2.SamplingParams(temperature=0.0, **sampling)  # type: ignore[arg-type]
    if max_tokens is not None:
        params.max_tokens = max_tokens
    return vllm_engine_pb2.GenerateRequest(
        request_id=rid,
        tokenized=vllm_engine_pb2.TokenizedInput(input_ids=ids),
        sampling_params=params,
        stream=stream,
    )


def native_tokens(native: engine_pb2_grpc.EngineStub, ids: list[int], n: int) -> list[int]:
    req = engine_pb2.EngineGenerateRequest(
        request_id=f"native-{time.monotonic_ns()}",
        prompt_token_ids=ids,
        sampling=engine_pb2.EngineSamplingParams(max_tokens=n, ignore_eos=True),
    )
    return [t for c in native.Generate(req, timeout=120) for t in c.token_ids]


def refused(call: object) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        list(call)  # type: ignore[call-overload]
    return err.value


def refused_naming(call: object, *words: str) -> None:
    """The call fails with INVALID_ARGUMENT whose message has every one of ``words``."""
    err = refused(call)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    for w in words:
        assert w in (err.details() or ""), err.details()


def test_stream_matches_the_native_protocol(
    vllm: vllm_engine_pb2_grpc.VllmEngineStub, native: engine_pb2_grpc.EngineStub
) -> None:
    msgs = list(vllm.Generate(vllm_request("v-stream", PROMPT, 12, ignore_eos=True), timeout=120))
    chunks, last = msgs[:-1], msgs[-1]
    assert all(m.WhichOneof("response") == "chunk" for m in chunks)
    assert chunks
    assert last.WhichOneof("response") == "complete"
    streamed = [t for m in chunks for t in m.chunk.token_ids]
    assert sum(m.chunk.completion_tokens for m in chunks) == 12
    assert all(m.chunk.prompt_tokens == len(PROMPT) for m in chunks)
    done = last.complete
    assert list(done.output_ids) == streamed == native_tokens(native, PROMPT, 12)
    assert (done.finish_reason, done.prompt_tokens, done.completion_tokens) == (
        "length",
        len(PROMPT),
        12,
    )


def test_stream_false_sends_only_the_complete(vllm: vllm_engine_pb2_grpc.VllmEngineStub) -> None:
    msgs = list(vllm.Generate(vllm_request("v-unary", PROMPT, 6, stream=False), timeout=120))
    assert [m.WhichOneof("response") for m in msgs] == ["complete"]
    assert msgs[0].complete.completion_tokens == len(msgs[0].complete.output_ids) <= 6


def test_eos_ends_with_stop_and_the_matched_token(
    vllm: vllm_engine_pb2_grpc.VllmEngineStub, tok: TextTokenizer
) -> None:
    prompt, _ = tok.encode_chat([Message("user", "Say hi.")])
    msgs = list(vllm.Generate(vllm_request("v-eos", prompt, 200), timeout=120))
    done = msgs[-1].complete
    assert done.finish_reason == "stop"
    assert done.WhichOneof("matched_stop") == "matched_token_id"
    assert done.matched_token_id in tok.special.eos_token_ids


def test_unset_max_tokens_uses_what_the_context_leaves(
    vllm: vllm_engine_pb2_grpc.VllmEngineStub, tok: TextTokenizer
) -> None:
    prompt, _ = tok.encode_chat([Message("user", "Say hi.")])
    done = list(vllm.Generate(vllm_request("v-nomax", prompt, None), timeout=120))[-1].complete
    assert done.finish_reason == "stop"
    assert done.completion_tokens >= 1


def test_stop_string_ends_the_request_and_frees_its_blocks(
    vllm: vllm_engine_pb2_grpc.VllmEngineStub,
    native: engine_pb2_grpc.EngineStub,
    tok: TextTokenizer,
) -> None:
    before = wait_for_idle(native)
    full = native_tokens(native, PROMPT, 24)
    text = tok.decode(full)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), text
    msgs = list(vllm.Generate(vllm_request("v-stopstr", PROMPT, 24, stop=[stop]), timeout=120))
    done = msgs[-1].complete
    assert (done.finish_reason, done.matched_stop_str) == ("stop", stop)
    got = list(done.output_ids)
    assert got == full[: len(got)]
    assert len(got) < len(full)
    assert stop in tok.decode(got)
    assert stop not in tok.decode(got[:-1])
    assert [t for m in msgs[:-1] for t in m.chunk.token_ids] == got
    assert wait_for_idle(native) == before


def test_logprobs_when_asked(vllm: vllm_engine_pb2_grpc.VllmEngineStub) -> None:
    msgs = list(vllm.Generate(vllm_request("v-lp", PROMPT, 4, logprobs=3), timeout=120))
    for m in msgs[:-1]:
        lp = m.chunk.output_logprobs
        assert list(lp.token_ids) == list(m.chunk.token_ids)
        assert all(len(t.values) == 3 and len(t.token_ids) == 3 for t in lp.top_logprobs)
    done = msgs[-1].complete
    assert list(done.output_logprobs.token_ids) == list(done.output_ids)
    # greedy: the chosen token is the best alternative
    top = done.output_logprobs.top_logprobs
    assert [t.token_ids[0] for t in top] == list(done.output_ids)
    zero = list(vllm.Generate(vllm_request("v-lp0", PROMPT, 2, logprobs=0), timeout=120))
    assert len(zero[-1].complete.output_logprobs.token_logprobs) == 2
    assert not zero[-1].complete.output_logprobs.top_logprobs
    none = list(vllm.Generate(vllm_request("v-lpn", PROMPT, 2), timeout=120))
    assert not none[-1].complete.HasField("output_logprobs")


def test_abort_by_id_ends_the_stream_and_frees_kv_blocks(
    vllm: vllm_engine_pb2_grpc.VllmEngineStub, native: engine_pb2_grpc.EngineStub
) -> None:
    before = wait_for_idle(native)
    call = vllm.Generate(vllm_request("v-abort", PROMPT, 1500, ignore_eos=True), timeout=120)
    msgs = []
    for m in call:
        msgs.append(m)
        if len(msgs) == 3:
            busy = native.GetStats(engine_pb2.GetStatsRequest())
            assert busy.num_kv_blocks_used > before
            assert busy.num_running == 1
            vllm.Abort(vllm_engine_pb2.AbortRequest(request_ids=["v-abort"]))
    done = msgs[-1].complete
    assert done.finish_reason == "abort"
    assert done.completion_tokens < 1500
    assert wait_for_idle(native) == before
    load = vllm.GetLoads(vllm_engine_pb2.GetLoadsRequest()).loads[0]
    assert (load.num_running_reqs, load.num_waiting_reqs) == (0, 0)


def test_client_cancel_frees_kv_blocks(
    vllm: vllm_engine_pb2_grpc.VllmEngineStub, native: engine_pb2_grpc.EngineStub
) -> None:
    before = wait_for_idle(native)
    call = vllm.Generate(vllm_request("v-cancel", PROMPT, 1500, ignore_eos=True), timeout=120)
    for i, _ in enumerate(call):
        if i == 2:
            assert native.GetStats(engine_pb2.GetStatsRequest()).num_kv_blocks_used > before
            call.cancel()  # type: ignore[attr-defined]
            break
    assert wait_for_idle(native) == before


@pytest.mark.parametrize(
    ("field", "req"),
    [
        ("text", vllm_engine_pb2.GenerateRequest(request_id="t", text="hello")),
        ("sampling_params.n", vllm_request("n", PROMPT, 4, n=2)),
        ("sampling_params.logit_bias", vllm_request("b", PROMPT, 4, logit_bias={5: 1.0})),
        ("sampling_params.prompt_logprobs", vllm_request("p", PROMPT, 4, prompt_logprobs=1)),
        ("sampling_params.logprobs", vllm_request("l", PROMPT, 4, logprobs=-1)),
    ],
)
def test_what_the_engine_cannot_apply_is_refused_by_name(
    vllm: vllm_engine_pb2_grpc.VllmEngineStub, field: str, req: vllm_engine_pb2.GenerateRequest
) -> None:
    refused_naming(vllm.Generate(req, timeout=30), field, "does not support")


def test_refused_kv_transfer_and_rank(vllm: vllm_engine_pb2_grpc.VllmEngineStub) -> None:
    req = vllm_request("kv", PROMPT, 4)
    req.kv_transfer_params_json = "{}"
    assert "kv_transfer_params_json" in (refused(vllm.Generate(req)).details() or "")
    req = vllm_request("dp", PROMPT, 4)
    req.data_parallel_rank = 1
    assert "data_parallel_rank" in (refused(vllm.Generate(req)).details() or "")


def test_info_health_and_loads(
    vllm: vllm_engine_pb2_grpc.VllmEngineStub, native: engine_pb2_grpc.EngineStub
) -> None:
    info = vllm.GetModelInfo(vllm_engine_pb2.GetModelInfoRequest())
    ours = native.GetModelInfo(engine_pb2.GetModelInfoRequest())
    assert info.served_model_name == ours.model
    assert info.is_generation
    assert (info.vocab_size, info.max_context_length) == (ours.vocab_size, ours.max_context_length)
    assert list(info.eos_token_ids) == list(ours.eos_token_ids)
    assert info.architectures == ["LlamaForCausalLM"]
    assert vllm.HealthCheck(vllm_engine_pb2.HealthCheckRequest()).healthy
    server = vllm.GetServerInfo(vllm_engine_pb2.GetServerInfoRequest())
    assert server.block_size == ours.kv_block_size
    assert server.max_num_seqs == 16
    loads = vllm.GetLoads(vllm_engine_pb2.GetLoadsRequest())
    stats = native.GetStats(engine_pb2.GetStatsRequest())
    assert loads.dp_rank_count == 1
    load = loads.loads[0]
    assert load.max_running_requests == stats.max_num_seqs
    assert load.max_total_num_tokens == stats.num_kv_blocks_total * ours.kv_block_size


def test_unimplemented_rpcs_say_so(vllm: vllm_engine_pb2_grpc.VllmEngineStub) -> None:
    with pytest.raises(grpc.RpcError) as err:
        vllm.Embed(vllm_engine_pb2.EmbedRequest(request_id="e"))
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert "Embed" in (err.value.details() or "")


def test_get_tokenizer_streams_a_zip_with_its_sha256(
    vllm: vllm_engine_pb2_grpc.VllmEngineStub, model_dir: Path
) -> None:
    chunks = list(vllm.GetTokenizer(common_pb2.GetTokenizerRequest()))
    data = b"".join(c.data for c in chunks)
    assert [bool(c.sha256) for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest()
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        assert zf.read("tokenizer.json") == (model_dir / "tokenizer.json").read_bytes()
        assert "tokenizer_config.json" in zf.namelist()
