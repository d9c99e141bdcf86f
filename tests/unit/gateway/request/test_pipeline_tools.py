"""Tools through the pipeline (scripted engine, real tokenizer): the tools are prompt
tokens, a named choice's constraint reaches the engine job, the model's call comes back
as tool call deltas with TOOL_CALLS, and a bad tool is refused before any admission."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import grpc
import pytest

from gateway.domain import CallContext, Chunk, GatewayError
from gateway.request.pipeline import Pipeline
from llm.v1 import common_pb2, gateway_pb2
from tests.unit.gateway.request.fakes import TENANT, FakeDispatcher, limiter
from tests.unit.gateway.request.test_pipeline import pipeline_of
from tokenizer_svc.tokenizer import TextTokenizer

TOOL = common_pb2.Tool(
    type="function",
    function=common_pb2.FunctionDefinition(
        name="now", parameters=json.dumps({"type": "object", "properties": {}})
    ),
)


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> TextTokenizer:
    return TextTokenizer(model_dir)


def request(**kw: object) -> gateway_pb2.GenerateRequest:
    req = gateway_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(max_tokens=32), **kw)  # type: ignore[arg-type]
    req.messages.messages.add(role="user", content="What time is it?")
    return req


async def collect(pipeline: Pipeline, req: gateway_pb2.GenerateRequest) -> list[Chunk]:
    async with contextlib.aclosing(pipeline.generate(req, CallContext(tenant=TENANT))) as chunks:
        return [c async for c in chunks]


async def test_a_call_in_the_output_comes_back_as_deltas(tokenizer: TextTokenizer) -> None:
    out = 'It is late.<tool_call>{"name": "now", "arguments": {}}</tool_call>'
    engine = FakeDispatcher(tokens=tuple(tokenizer.encode(out, add_special_tokens=False)))
    async with pipeline_of(tokenizer, engine, limiter()) as pipeline:
        chunks = await collect(pipeline, request(tools=[TOOL]))
        plain = await collect(pipeline, request())
    assert "".join(c.text for c in chunks) == "It is late."
    deltas = [tc for c in chunks for tc in c.tool_calls]
    assert [(d.index, d.name, d.arguments) for d in deltas] == [(0, "now", ""), (0, "", "{}")]
    assert chunks[-1].finish_reason == common_pb2.TOOL_CALLS
    with_tools, without = (len(j.prompt_token_ids) for j in engine.jobs)
    assert with_tools > without + 40  # the tool section is in the prompt
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.prompt_tokens == with_tools
    assert "".join(c.text for c in plain) == out  # no tools: nothing is read as a call
    assert not engine.jobs[1].sampling.HasField("guided")


async def test_a_named_choice_constrains_the_engine_job(tokenizer: TextTokenizer) -> None:
    engine = FakeDispatcher(tokens=tuple(tokenizer.encode("{}", add_special_tokens=False)))
    async with pipeline_of(tokenizer, engine, limiter()) as pipeline:
        req = request(tools=[TOOL], tool_choice=common_pb2.ToolChoice(function_name="now"))
        chunks = await collect(pipeline, req)
    assert json.loads(engine.jobs[0].sampling.guided.json_schema) == {
        "type": "object",
        "properties": {},
    }
    assert [(d.name, d.arguments) for c in chunks for d in c.tool_calls] == [
        ("now", ""),
        ("", "{}"),
    ]


async def test_response_format_reaches_the_engine_and_a_bad_tool_is_refused_first(
    tokenizer: TextTokenizer,
) -> None:
    lim, engine = limiter(), FakeDispatcher()
    async with pipeline_of(tokenizer, engine, lim) as pipeline:
        req = request()
        req.sampling.guided.regex = "[a-z]+"
        await collect(pipeline, req)
        assert engine.jobs[0].sampling.guided.regex == "[a-z]+"
        bad = request(tools=[TOOL], tool_choice=common_pb2.ToolChoice(function_name="later"))
        with pytest.raises(GatewayError) as info:
            await collect(pipeline, bad)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "tool_choice names function 'later'" in info.value.message
    assert len(engine.jobs) == 1
    assert len(lim.settles) == 1  # the refused one reserved nothing


async def test_a_configured_model_gets_its_thought_apart(tokenizer: TextTokenizer) -> None:
    out = "<think>Paris, surely.</think>Paris."
    engine = FakeDispatcher(tokens=tuple(tokenizer.encode(out, add_special_tokens=False)))
    async with pipeline_of(tokenizer, engine, limiter()) as pipeline:
        plain = await collect(pipeline, request())
        pipeline.config.reasoning_parsers = {"m": "think"}  # the served model's name
        chunks = await collect(pipeline, request())
    assert "".join(c.text for c in plain) == out  # off by default
    assert "".join(c.reasoning_text for c in chunks) == "Paris, surely."
    assert "".join(c.text for c in chunks) == "Paris."
