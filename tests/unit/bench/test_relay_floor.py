"""The bench's transport floor: a bare Gateway.Generate relay in front of an engine.
Real grpc.aio servers on loopback: a scripted Engine, and the floor before it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vllm_grpc  # type: ignore[import-untyped]

from bench.gatewaylib.relay_floor import RelayFloor
from llm.v1 import common_pb2, engine_pb2, engine_pb2_grpc, gateway_pb2, gateway_pb2_grpc
from tests.unit.bench.test_gatewaylib_stock import FakeVllm
from tests.unit.gateway.fleet.engine_client.scripted import start
from tokenizer_svc.tokenizer import TextTokenizer


class ScriptedEngine(engine_pb2_grpc.EngineServicer):
    """Streams ``max_tokens`` chunks of one token each (or fails with ``fail``), and
    records what it was asked and whether a stream was cancelled."""

    def __init__(self) -> None:
        self.requests: list[engine_pb2.EngineGenerateRequest] = []
        self.metadata: list[dict[str, str]] = []
        self.fail: grpc.StatusCode | None = None
        self.hold = False  # stream one chunk, then wait until cancelled
        self.cancelled = asyncio.Event()

    async def Generate(  # type: ignore[override]
        self, request: engine_pb2.EngineGenerateRequest, context: Any
    ) -> AsyncIterator[engine_pb2.EngineGenerateResponse]:
        self.requests.append(request)
        self.metadata.append({k: str(v) for k, v in context.invocation_metadata() or ()})
        if self.fail is not None:
            await context.abort(self.fail, "scripted failure")
        n = request.sampling.max_tokens
        try:
            for i in range(n):
                last = i == n - 1
                yield engine_pb2.EngineGenerateResponse(
                    token_ids=[100 + i],
                    finish_reason=common_pb2.LENGTH
                    if last
                    else common_pb2.FINISH_REASON_UNSPECIFIED,
                )
                if self.hold:
                    await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise


@contextlib.asynccontextmanager
async def floor_before(
    engine: Any,
    add_engine: Callable[[Any, grpc.aio.Server], None],
    stub_of: Callable[[grpc.aio.Channel], Any],
    model_dir: Path,
    **floor_args: Any,
) -> AsyncIterator[gateway_pb2_grpc.GatewayAsyncStub]:
    """A scripted engine server, the floor in front of it, and a client of the floor."""
    engine_server, engine_address = await start(add_engine, engine)
    engine_channel = grpc.aio.insecure_channel(engine_address)
    floor = RelayFloor(stub_of(engine_channel), TextTokenizer(model_dir), **floor_args)
    floor_server, floor_address = await start(gateway_pb2_grpc.add_GatewayServicer_to_server, floor)
    client = grpc.aio.insecure_channel(floor_address)
    try:
        yield gateway_pb2_grpc.GatewayStub(client)
    finally:
        await client.close(None)
        await floor_server.stop(0)
        await engine_channel.close(None)
        await engine_server.stop(0)


@pytest.fixture
async def relay(
    model_dir: Path,
) -> AsyncIterator[tuple[ScriptedEngine, gateway_pb2_grpc.GatewayAsyncStub]]:
    engine = ScriptedEngine()  # type: ignore[abstract]  # Generate only
    add = engine_pb2_grpc.add_EngineServicer_to_server
    metadata = (("x-token", "t"),)
    async with floor_before(
        engine, add, engine_pb2_grpc.EngineStub, model_dir, call_metadata=metadata
    ) as stub:
        yield engine, stub


def generate(prompt: str, max_tokens: int, request_id: str = "") -> gateway_pb2.GenerateRequest:
    sampling = common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return gateway_pb2.GenerateRequest(prompt=prompt, sampling=sampling, request_id=request_id)


async def test_every_engine_chunk_is_relayed_in_order_with_headers_first(
    relay: tuple[ScriptedEngine, gateway_pb2_grpc.GatewayAsyncStub], model_dir: Path
) -> None:
    engine, stub = relay
    call = stub.Generate(generate("The sea and the wind", 4, "floor-1"))
    chunks = [c async for c in call]
    assert [list(c.token_ids) for c in chunks] == [[100], [101], [102], [103]]
    assert [c.finish_reason for c in chunks] == [0, 0, 0, common_pb2.LENGTH]
    assert {c.request_id for c in chunks} == {"floor-1"}
    assert dict(await call.initial_metadata())["x-request-id"] == "floor-1"
    sent = engine.requests[0]
    ids = TextTokenizer(model_dir).encode("The sea and the wind")
    assert list(sent.prompt_token_ids) == ids
    assert (sent.sampling.max_tokens, sent.sampling.ignore_eos) == (4, True)
    assert engine.metadata[0]["x-request-id"] == "floor-1"
    assert engine.metadata[0]["x-token"] == "t"


async def test_a_prompt_is_encoded_once(model_dir: Path) -> None:
    unused = engine_pb2_grpc.EngineStub(grpc.aio.insecure_channel("127.0.0.1:1"))
    floor = RelayFloor(unused, TextTokenizer(model_dir))
    first = floor.prompt_ids("one prompt")
    assert floor.prompt_ids("one prompt") is first  # remembered, not encoded again
    for i in range(200):  # bounded: many distinct prompts never grow it past its cap
        floor.prompt_ids(f"prompt {i}")
    assert len(floor._ids) <= 64


async def test_an_engine_failure_ends_the_call_with_the_engines_status(
    relay: tuple[ScriptedEngine, gateway_pb2_grpc.GatewayAsyncStub],
) -> None:
    engine, stub = relay
    engine.fail = grpc.StatusCode.RESOURCE_EXHAUSTED
    with pytest.raises(grpc.aio.AioRpcError) as err:
        _ = [c async for c in stub.Generate(generate("hello", 2))]
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.value.details() == "scripted failure"


async def test_a_client_that_leaves_cancels_the_engine_call(
    relay: tuple[ScriptedEngine, gateway_pb2_grpc.GatewayAsyncStub],
) -> None:
    engine, stub = relay
    engine.hold = True
    call = stub.Generate(generate("hello", 5))
    first = await call.read()
    assert isinstance(first, gateway_pb2.GenerateResponse)
    assert list(first.token_ids) == [100]
    call.cancel()
    await asyncio.wait_for(engine.cancelled.wait(), 10)


async def test_a_request_without_a_prompt_is_refused(
    relay: tuple[ScriptedEngine, gateway_pb2_grpc.GatewayAsyncStub],
) -> None:
    engine, stub = relay
    chat = gateway_pb2.GenerateRequest(
        messages=common_pb2.ChatMessages(
            messages=[common_pb2.ChatMessage(role="user", content="hi")]
        )
    )
    with pytest.raises(grpc.aio.AioRpcError) as err:
        _ = [c async for c in stub.Generate(chat)]
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert engine.requests == []


async def test_over_a_vllm_engine_the_relay_makes_its_call_and_relays_its_chunks(
    model_dir: Path,
) -> None:
    engine = FakeVllm()  # one chunk per token, then a GenerateComplete repeating the last
    add = vllm_grpc.add_VllmEngineServicer_to_server
    async with floor_before(
        engine, add, vllm_grpc.VllmEngineStub, model_dir, protocol="vllm"
    ) as stub:
        chunks = [c async for c in stub.Generate(generate("The sea and the wind", 3))]
    # the closing GenerateComplete repeats the last token: not relayed again
    assert [list(c.token_ids) for c in chunks] == [[100], [101], [102]]
    sent = engine.requests[0]
    assert list(sent.tokenized.input_ids) == TextTokenizer(model_dir).encode("The sea and the wind")
    p = sent.sampling_params
    assert (p.max_tokens, p.ignore_eos, p.temperature, sent.stream) == (3, True, 0.0, True)


async def test_with_work_each_chunk_carries_its_text_and_each_prompt_is_encoded_anew(
    model_dir: Path,
) -> None:
    """``--work``: the relay detokenizes what it relays (the text of every chunk joins
    into the decode of all their tokens) and encodes every request's prompt, as SMG does."""
    tok = TextTokenizer(model_dir)
    engine = ScriptedEngine()  # type: ignore[abstract]  # Generate only
    add = engine_pb2_grpc.add_EngineServicer_to_server
    async with floor_before(engine, add, engine_pb2_grpc.EngineStub, model_dir, work=True) as stub:
        chunks = [c async for c in stub.Generate(generate("The sea and the wind", 6))]
        again = [c async for c in stub.Generate(generate("The sea and the wind", 2))]
    ids = [i for c in chunks for i in c.token_ids]
    assert ids == list(range(100, 106))
    assert "".join(c.text for c in chunks) == tok.tokenizer.decode(ids)
    assert any(c.text for c in chunks)
    assert [i for c in again for i in c.token_ids] == [100, 101]
    unused = engine_pb2_grpc.EngineStub(grpc.aio.insecure_channel("127.0.0.1:1"))
    floor = RelayFloor(unused, tok, work=True)
    assert floor.prompt_ids("one prompt") == tok.encode("one prompt")
    assert floor.prompt_ids("one prompt") is not floor.prompt_ids("one prompt")  # anew
    assert floor._ids == {}  # nothing remembered
