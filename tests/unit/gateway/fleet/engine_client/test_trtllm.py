"""The TrtllmService client against a scripted TrtllmService on loopback gRPC: the llm.v1
request as TrtllmService's (a cache salt per tenant, zeros left unset, stop tokens
stripped by the engine), cached tokens shown (the cache is salted), Abort on cancel,
stats with only the batch size, health; and a replica of a trtllm:// entry turning
healthy through the seam."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from smg_grpc_proto.generated import trtllm_service_pb2 as pb  # type: ignore[import-untyped]
from smg_grpc_proto.generated import (  # type: ignore[import-untyped]
    trtllm_service_pb2_grpc as pb_grpc,
)

from common.breaker import BreakerPolicy, CircuitBreaker
from gateway.fleet.engine_client.trtllm import TrtllmClient
from gateway.fleet.replica import Replica
from gateway.fleet.tokenizers import TokenizerSet
from llm.v1 import common_pb2, engine_pb2
from tests.unit.gateway.fleet.engine_client.scripted import (
    ScriptedGenerate,
    cancel_after_first_chunk,
    serving,
    tokenizer_zip,
    until,
    zip_chunks,
)


class ScriptedTrtllm(ScriptedGenerate, pb_grpc.TrtllmServiceServicer):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__()
        self.status = "OK"

    async def Abort(self, request: Any, context: Any) -> Any:
        self.script.aborted.append(request.request_id)
        return pb.AbortResponse(success=True)

    async def HealthCheck(self, request: Any, context: Any) -> Any:
        return pb.HealthCheckResponse(status=self.status)

    async def GetModelInfo(self, request: Any, context: Any) -> Any:
        return pb.GetModelInfoResponse(
            model_id="smol-trt", max_seq_len=4096, max_batch_size=64, vocab_size=49152
        )

    async def GetTokenizer(self, request: Any, context: Any) -> AsyncIterator[Any]:
        for chunk in self.script.zip_chunks:
            yield chunk


@pytest.fixture
async def engine() -> AsyncIterator[tuple[ScriptedTrtllm, TrtllmClient, str]]:
    add = pb_grpc.add_TrtllmServiceServicer_to_server
    async with serving(add, ScriptedTrtllm(), lambda a: TrtllmClient(a, poll_interval_s=0.02)) as e:
        yield e[0], e[1], e[1].address


def request(tenant: str = "t1", **sampling: Any) -> engine_pb2.EngineGenerateRequest:
    return engine_pb2.EngineGenerateRequest(
        request_id="r1",
        prompt_token_ids=[10, 11],
        sampling=engine_pb2.EngineSamplingParams(**{"max_tokens": 8, **sampling}),
        tenant_id=tenant,
        cache_salt=f"tenant:{tenant}",
    )


def complete(**fields: Any) -> Any:
    return pb.GenerateResponse(complete=pb.GenerateComplete(**fields))


async def collect(client: TrtllmClient, req: engine_pb2.EngineGenerateRequest) -> list[Any]:
    return [r async for r in client.generate(req, timeout=10, metadata=())]


async def test_the_request_the_engine_gets_and_the_chunks_the_gateway_gets(
    engine: tuple[ScriptedTrtllm, TrtllmClient, str],
) -> None:
    servicer, client, _ = engine
    servicer.script.responses = [
        pb.GenerateResponse(chunk=pb.GenerateStreamChunk(token_ids=[5, 6])),
        complete(
            output_token_ids=[5, 6],
            finish_reason="stop",
            matched_token_id=9,
            prompt_tokens=2,
            completion_tokens=2,
            cached_tokens=1,
        ),
    ]
    req = request(seed=2**40, stop_token_ids=[9], min_tokens=1, temperature=0.7)
    req.resumed_output_token_ids.append(4)
    out = await collect(client, req)
    assert [list(r.token_ids) for r in out] == [[5, 6], []]
    assert (out[-1].finish_reason, out[-1].stop_token_id) == (common_pb2.STOP, 9)
    assert out[-1].usage.cached_prompt_tokens == 1  # the tenant's own: the cache is salted
    wire = servicer.script.requests[0]
    assert list(wire.tokenized.input_token_ids) == [10, 11, 4]
    assert (wire.max_tokens, wire.sampling_config.min_tokens) == (7, 0)
    assert wire.sampling_config.seed == 2**40  # a uint64 here
    assert not wire.sampling_config.HasField("top_k")  # llm.v1's 0 = off = unset here
    assert not wire.sampling_config.HasField("top_p")
    assert list(wire.stop_token_ids) == [9]
    assert not wire.include_stop_token_in_output
    assert wire.streaming
    assert wire.output_config.exclude_input_from_output


async def test_each_tenant_gets_its_own_cache_salt(
    engine: tuple[ScriptedTrtllm, TrtllmClient, str],
) -> None:
    servicer, client, _ = engine
    servicer.script.responses = [complete(finish_reason="length")]
    for tenant in ("a", "b", "a"):
        await collect(client, request(tenant))
    salts = [r.cache_salt_id for r in servicer.script.requests]
    assert salts[0] == salts[2] != salts[1]


async def test_no_salt_is_sent_for_an_unsalted_request(
    engine: tuple[ScriptedTrtllm, TrtllmClient, str],
) -> None:
    servicer, client, _ = engine
    servicer.script.responses = [complete(finish_reason="length")]
    unsalted = request("a")
    unsalted.ClearField("cache_salt")
    await collect(client, unsalted)
    assert not servicer.script.requests[-1].HasField("cache_salt_id")


async def test_cancel_sends_abort(engine: tuple[ScriptedTrtllm, TrtllmClient, str]) -> None:
    servicer, client, _ = engine
    servicer.script.responses = [pb.GenerateResponse(chunk=pb.GenerateStreamChunk(token_ids=[5]))]
    await cancel_after_first_chunk(client, request(), servicer.script)


async def test_model_info_stats_and_health(
    engine: tuple[ScriptedTrtllm, TrtllmClient, str],
) -> None:
    servicer, client, _ = engine
    info = await client.model_info(timeout_s=5)
    assert (info.model, info.max_context_length, info.backend) == ("smol-trt", 4096, "trtllm")
    stats = await client.stats(timeout_s=5)
    assert stats.max_num_seqs == 64  # no load RPC: the router weighs its own calls in flight
    answers = client.watch_health()
    assert await anext(answers) == ""
    servicer.status = "engine stopped"
    assert await anext(answers) == "HealthCheck says 'engine stopped'"
    await answers.aclose()


async def test_a_replica_of_a_trtllm_entry_turns_healthy_and_unhealthy(
    engine: tuple[ScriptedTrtllm, TrtllmClient, str], model_dir: Path
) -> None:
    servicer, _, address = engine
    servicer.script.zip_chunks = zip_chunks(tokenizer_zip(model_dir))
    entry = f"trtllm://{address}?model=smol&version=v2"
    replica = Replica(
        entry, CircuitBreaker(entry, BreakerPolicy()), 0.02, tokenizers=TokenizerSet()
    )
    assert replica.address == entry
    replica.start()
    try:
        await until("the replica to turn healthy", lambda: replica.healthy)
        assert replica.info is not None
        assert (replica.info.model, replica.info.version) == ("smol", "v2")
        assert replica.info.tokenizer_digest  # learned from the zip
        servicer.status = "draining"
        await until("the replica to turn unhealthy", lambda: not replica.healthy)
        assert replica.last_error == "HealthCheck says 'draining'"
    finally:
        await replica.close()
