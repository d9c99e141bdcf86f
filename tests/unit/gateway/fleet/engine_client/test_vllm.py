"""The VllmEngine client against a scripted VllmEngine on loopback gRPC: the llm.v1
request as VllmEngine's (resumption through the prompt, refusals naming the field),
its chunks and last message as llm.v1 chunks (a held EOS dropped, cached tokens never
shown), Abort on cancel, loads as EngineStats, health, the tokenizer zip."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as pb  # type: ignore[import-untyped]
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as pb_grpc  # type: ignore[import-untyped]

from gateway.fleet.engine_client.vllm import VllmClient
from gateway.fleet.tokenizers import TokenizerSet
from llm.v1 import common_pb2, engine_pb2
from tests.unit.gateway.fleet.engine_client.scripted import (
    ScriptedGenerate,
    serving,
    tokenizer_zip,
    until,
    zip_chunks,
)

EOS = 2


class ScriptedVllm(ScriptedGenerate, pb_grpc.VllmEngineServicer):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__()
        self.healthy = True

    async def Abort(self, request: Any, context: Any) -> Any:
        self.script.aborted.extend(request.request_ids)
        return pb.AbortResponse()

    async def HealthCheck(self, request: Any, context: Any) -> Any:
        return pb.HealthCheckResponse(healthy=self.healthy, message="engine dead")

    async def GetModelInfo(self, request: Any, context: Any) -> Any:
        return pb.GetModelInfoResponse(
            served_model_name="smol",
            model_path="/models/smol",
            max_context_length=2048,
            vocab_size=49152,
            eos_token_ids=[EOS],
        )

    async def GetServerInfo(self, request: Any, context: Any) -> Any:
        return pb.GetServerInfoResponse(is_paused=self.paused, max_num_seqs=99)

    async def GetLoads(self, request: Any, context: Any) -> Any:
        return pb.GetLoadsResponse(
            loads=[
                pb.SchedulerLoad(
                    num_running_reqs=3, num_waiting_reqs=1, token_usage=0.2, max_running_requests=8
                ),
                pb.SchedulerLoad(
                    num_running_reqs=1, num_waiting_reqs=4, token_usage=0.6, max_running_requests=8
                ),
            ]
        )

    async def GetTokenizer(self, request: Any, context: Any) -> AsyncIterator[Any]:
        for chunk in self.script.zip_chunks:
            yield chunk


@pytest.fixture
async def engine() -> AsyncIterator[tuple[ScriptedVllm, VllmClient]]:
    add = pb_grpc.add_VllmEngineServicer_to_server
    make = lambda a: VllmClient(a, "s" * 32, poll_interval_s=0.02, version="v7")  # noqa: E731
    async with serving(add, ScriptedVllm(), make) as e:
        yield e


def request(**sampling: Any) -> engine_pb2.EngineGenerateRequest:
    return engine_pb2.EngineGenerateRequest(
        request_id="r1",
        prompt_token_ids=[10, 11, 12],
        sampling=engine_pb2.EngineSamplingParams(**{"max_tokens": 8, **sampling}),
        priority=common_pb2.CRITICAL,
        tenant_id="t",
        tenant_weight=3.0,
    )


def chunk(*ids: int) -> Any:
    return pb.GenerateResponse(chunk=pb.GenerateStreamChunk(token_ids=ids))


async def collect(client: VllmClient, req: engine_pb2.EngineGenerateRequest) -> list[Any]:
    return [r async for r in client.generate(req, timeout=10, metadata=(("x-request-id", "r1"),))]


async def test_a_stream_becomes_llm_v1_chunks_with_the_eos_dropped_and_no_cached_count(
    engine: tuple[ScriptedVllm, VllmClient],
) -> None:
    servicer, client = engine
    await client.model_info(timeout_s=5)  # the EOS ids
    servicer.script.responses = [
        chunk(5, 6),
        chunk(7, EOS),
        pb.GenerateResponse(
            complete=pb.GenerateComplete(
                output_ids=[5, 6, 7, EOS],
                finish_reason="stop",
                prompt_tokens=3,
                completion_tokens=4,
                cached_tokens=2,
            )
        ),
    ]
    out = await collect(client, request(temperature=0.5, seed=42, logprobs=0))
    assert [list(r.token_ids) for r in out] == [[5, 6], [7], []]
    last = out[-1]
    assert last.finish_reason == common_pb2.STOP
    assert last.stop_token_id == EOS
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (3, 4)
    assert last.usage.cached_prompt_tokens == 0  # a shared, unsalted cache: never shown
    wire = servicer.script.requests[0]
    assert list(wire.tokenized.input_ids) == [10, 11, 12]
    assert wire.stream
    assert wire.request_id == "r1"
    sp = wire.sampling_params
    assert (sp.max_tokens, sp.seed, sp.top_p, sp.repetition_penalty) == (8, 42, 1.0, 1.0)
    assert sp.temperature == pytest.approx(0.5)
    assert not sp.HasField("logprobs")
    md = servicer.script.metadata[0]
    assert md["x-service-token"] == "s" * 32
    assert md["x-request-id"] == "r1"


async def test_a_held_stop_id_that_did_not_stop_is_released(
    engine: tuple[ScriptedVllm, VllmClient],
) -> None:
    servicer, client = engine
    servicer.script.responses = [
        chunk(5, 9),  # 9: a stop id, before min_tokens
        chunk(6),
        pb.GenerateResponse(complete=pb.GenerateComplete(finish_reason="length")),
    ]
    out = await collect(client, request(stop_token_ids=[9], min_tokens=3))
    assert [list(r.token_ids) for r in out] == [[5], [9, 6], []]
    assert out[-1].finish_reason == common_pb2.LENGTH
    assert out[-1].stop_token_id == 0


async def test_logprobs_come_through_with_the_rank(engine: tuple[ScriptedVllm, VllmClient]) -> None:
    servicer, client = engine
    lps = pb.OutputLogProbs(
        token_logprobs=[-0.5],
        token_ids=[5],
        top_logprobs=[pb.TopLogProbs(values=[-0.1, -0.5, -2.0], token_ids=[4, 5, 3])],
    )
    servicer.script.responses = [
        pb.GenerateResponse(chunk=pb.GenerateStreamChunk(token_ids=[5], output_logprobs=lps)),
        pb.GenerateResponse(complete=pb.GenerateComplete(output_ids=[5], finish_reason="length")),
    ]
    out = await collect(client, request(logprobs=2))
    assert servicer.script.requests[0].sampling_params.logprobs == 2
    (pos,) = out[0].logprobs
    assert (pos.chosen.token_id, pos.rank) == (5, 2)
    assert [a.token_id for a in pos.top] == [4, 5]  # the two asked for, best first


async def test_resumed_tokens_extend_the_prompt_and_shrink_the_limits(
    engine: tuple[ScriptedVllm, VllmClient],
) -> None:
    servicer, client = engine
    servicer.script.responses = [
        pb.GenerateResponse(complete=pb.GenerateComplete(output_ids=[1], finish_reason="length"))
    ]
    req = request(max_tokens=10, min_tokens=3)
    req.resumed_output_token_ids.extend([7, 8])
    out = await collect(client, req)
    assert list(out[-1].token_ids) == [1]  # the last message carried a token no chunk did
    wire = servicer.script.requests[0]
    assert list(wire.tokenized.input_ids) == [10, 11, 12, 7, 8]
    assert (wire.sampling_params.max_tokens, wire.sampling_params.min_tokens) == (8, 1)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda r: setattr(r, "speculative_decoding", False), "speculative_decoding"),
        (lambda r: setattr(r.sampling, "seed", 2**40), "sampling.seed"),
        (lambda r: r.sampling.stop_sequences.add(token_ids=[1, 2]), "sampling.stop_sequences"),
    ],
)
async def test_what_vllm_cannot_carry_is_refused_naming_the_field(
    engine: tuple[ScriptedVllm, VllmClient], change: Any, field: str
) -> None:
    servicer, client = engine
    req = request()
    change(req)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        client.generate(req, timeout=10, metadata=())
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in str(err.value.details())
    assert f"vllm://{client.address}" in str(err.value.details())
    assert servicer.script.requests == []  # nothing was sent


async def test_cancel_cancels_the_call_and_sends_abort(
    engine: tuple[ScriptedVllm, VllmClient],
) -> None:
    servicer, client = engine
    servicer.script.responses = [chunk(5)]
    servicer.script.hang = True
    stream = client.generate(request(), timeout=10, metadata=())
    async for first in stream:
        assert list(first.token_ids) == [5]
        break
    assert not stream.done()
    assert stream.cancel()
    assert stream.done()
    await until("the Abort", lambda: servicer.script.aborted == ["r1"])
    await servicer.script.cancelled.wait()
    assert not stream.cancel()  # once


async def test_an_abort_the_gateway_did_not_ask_for_is_unavailable(
    engine: tuple[ScriptedVllm, VllmClient],
) -> None:
    servicer, client = engine
    servicer.script.responses = [
        chunk(5),
        pb.GenerateResponse(complete=pb.GenerateComplete(finish_reason="abort")),
    ]
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(client, request())
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE  # the dispatcher fails over


async def test_loads_model_info_and_health(engine: tuple[ScriptedVllm, VllmClient]) -> None:
    servicer, client = engine
    info = await client.model_info(timeout_s=5)
    assert (info.model, info.version, info.max_context_length) == ("smol", "v7", 2048)
    assert list(info.eos_token_ids) == [EOS]
    assert info.backend == "vllm"
    stats = await client.stats(timeout_s=5)
    assert (stats.num_running, stats.num_waiting, stats.max_num_seqs) == (4, 5, 16)
    assert stats.kv_cache_usage == pytest.approx(0.4)
    assert not stats.draining
    servicer.paused = True
    assert (await client.stats(timeout_s=5)).draining
    answers = client.watch_health()
    assert await anext(answers) == ""
    servicer.healthy = False
    assert await anext(answers) == "HealthCheck says unhealthy: engine dead"
    await answers.aclose()


async def test_the_tokenizer_zip_is_keyed_by_its_sha256(
    engine: tuple[ScriptedVllm, VllmClient], model_dir: Path
) -> None:
    servicer, client = engine
    data = tokenizer_zip(model_dir)
    servicer.script.zip_chunks = zip_chunks(data, size=500_000)
    tokenizers = TokenizerSet()
    info = await client.model_info(timeout_s=5)
    assert not client.announces_tokenizer
    assert info.tokenizer_digest == ""
    tok = await tokenizers.ensure(info, client, client.address)
    assert info.tokenizer_digest == hashlib.sha256(data).hexdigest()
    assert tokenizers.get(info) is tok
    assert tok.encode("The capital of France")  # a working tokenizer
    again = await client.model_info(timeout_s=5)
    assert await tokenizers.ensure(again, client, client.address) is tok  # parsed once
    assert len(tokenizers) == 1
