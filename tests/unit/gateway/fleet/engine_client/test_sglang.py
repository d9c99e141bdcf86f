"""The SglangScheduler client against a scripted SglangScheduler on loopback gRPC: the
llm.v1 request in SGLang's terms (max/min_new_tokens, top_k -1, no_stop_trim, logprob
flags, constraints), what it cannot carry refused by name, a stream with cumulative
counts as llm.v1 chunks (EOS dropped, no cached count), Abort by id on cancel, loads and
model info."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb  # type: ignore[import-untyped]
from smg_grpc_proto.generated import (  # type: ignore[import-untyped]
    sglang_scheduler_pb2_grpc as pb_grpc,
)

from gateway.fleet.engine_client.sglang import SglangClient
from llm.v1 import common_pb2, engine_pb2
from tests.unit.gateway.fleet.engine_client.scripted import (
    ScriptedGenerate,
    cancel_after_first_chunk,
    serving,
)
from tests.unit.gateway.fleet.engine_client.test_vllm import request

EOS = 2


class ScriptedSglang(ScriptedGenerate, pb_grpc.SglangSchedulerServicer):  # type: ignore[misc]
    async def Abort(self, request: Any, context: Any) -> Any:
        self.script.aborted.append(request.request_id)
        return pb.AbortResponse(success=True)

    async def HealthCheck(self, request: Any, context: Any) -> Any:
        return pb.HealthCheckResponse(healthy=True)

    async def GetModelInfo(self, request: Any, context: Any) -> Any:
        return pb.GetModelInfoResponse(
            served_model_name="smol-sgl", max_context_length=2048, eos_token_ids=[EOS]
        )

    async def GetServerInfo(self, request: Any, context: Any) -> Any:
        return pb.GetServerInfoResponse(is_paused=self.paused)

    async def GetLoads(self, request: Any, context: Any) -> Any:
        load = pb.SchedulerLoad(
            num_running_reqs=2, num_waiting_reqs=5, token_usage=0.5, max_running_requests=12
        )
        return pb.GetLoadsResponse(loads=[load])


@pytest.fixture
async def engine() -> AsyncIterator[tuple[ScriptedSglang, SglangClient]]:
    add = pb_grpc.add_SglangSchedulerServicer_to_server
    async with serving(add, ScriptedSglang(), lambda a: SglangClient(a, poll_interval_s=0.02)) as e:
        yield e


def chunk(*ids: int, total: int) -> Any:
    return pb.GenerateResponse(chunk=pb.GenerateStreamChunk(token_ids=ids, completion_tokens=total))


async def collect(client: SglangClient, req: engine_pb2.EngineGenerateRequest) -> list[Any]:
    return [r async for r in client.generate(req, timeout=10, metadata=())]


async def test_the_request_in_sglang_terms_and_the_stream_back(
    engine: tuple[ScriptedSglang, SglangClient],
) -> None:
    servicer, client = engine
    info = await client.model_info(timeout_s=5)
    assert (info.model, info.backend) == ("smol-sgl", "sglang")
    done = pb.GenerateComplete(
        output_ids=[5, 6, 7, EOS],
        finish_reason="stop",
        prompt_tokens=4,
        completion_tokens=4,
        cached_tokens=3,
    )
    servicer.script.responses = [
        chunk(5, 6, total=2),
        chunk(7, EOS, total=4),
        pb.GenerateResponse(complete=done),
    ]
    req = request(min_tokens=3, logprobs=2, include_stop_in_output=False, temperature=0.5)
    req.resumed_output_token_ids.append(4)
    out = await collect(client, req)
    assert [list(r.token_ids) for r in out] == [[5, 6], [7], []]
    assert (out[-1].finish_reason, out[-1].stop_token_id) == (common_pb2.STOP, EOS)
    assert out[-1].usage.cached_prompt_tokens == 0  # no salt: a shared cache, never shown
    wire = servicer.script.requests[0]
    assert list(wire.tokenized.input_ids) == [10, 11, 12, 4]
    sp = wire.sampling_params
    assert (sp.max_new_tokens, sp.min_new_tokens, sp.top_k, sp.top_p) == (7, 2, -1, 1.0)
    assert not sp.no_stop_trim
    assert (wire.return_logprob, wire.top_logprobs_num, wire.logprob_start_len) == (True, 2, -1)
    assert wire.stream


async def test_constraints_map_to_its_oneof(engine: tuple[ScriptedSglang, SglangClient]) -> None:
    servicer, client = engine
    servicer.script.responses = [pb.GenerateResponse(complete=pb.GenerateComplete())]
    choice = request()
    choice.sampling.guided.choice.choices.extend(["yes", "no"])
    grammar = request()
    grammar.sampling.guided.grammar = 'root ::= "a"'
    for req in (choice, grammar):
        await collect(client, req)
    got = [r.sampling_params for r in servicer.script.requests]
    assert got[0].ebnf_grammar == 'root ::= "yes" | "no"'
    assert got[1].ebnf_grammar == 'root ::= "a"'


async def test_a_seed_is_refused_naming_it(engine: tuple[ScriptedSglang, SglangClient]) -> None:
    servicer, client = engine
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(client, request(seed=7))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling.seed" in (err.value.details() or "")
    assert "sglang://" in (err.value.details() or "")
    assert not servicer.script.requests


async def test_cancel_aborts_by_id_and_stats_come_from_its_loads(
    engine: tuple[ScriptedSglang, SglangClient],
) -> None:
    servicer, client = engine
    servicer.script.responses = [chunk(5, total=1)]
    await cancel_after_first_chunk(client, request(), servicer.script)
    servicer.paused = True
    stats = await client.stats(timeout_s=5)
    assert (stats.num_running, stats.num_waiting, stats.max_num_seqs) == (2, 5, 12)
    assert stats.kv_cache_usage == pytest.approx(0.5)
    assert stats.draining
