"""Tool plans (checks, the constraint of each tool choice) and the output shaper over
pipeline chunks: deltas as the OpenAI client merges them, TOOL_CALLS at the end."""

from __future__ import annotations

import json
import re

import pytest

from gateway.domain import Chunk
from gateway.request.tools import OutputPlan, OutputShaper, plan_output
from llm.v1 import common_pb2, gateway_pb2

PARAMS = json.dumps({"type": "object", "properties": {"city": {"type": "string"}}})
TOOLS = [
    common_pb2.Tool(
        type="function", function=common_pb2.FunctionDefinition(name="weather", parameters=PARAMS)
    ),
    common_pb2.Tool(type="function", function=common_pb2.FunctionDefinition(name="now")),
]


def request(**kw: object) -> gateway_pb2.GenerateRequest:
    req = gateway_pb2.GenerateRequest(tools=TOOLS, **kw)  # type: ignore[arg-type]
    req.messages.messages.add(role="user", content="hi")
    return req


def plan(req: gateway_pb2.GenerateRequest, **kw: str) -> OutputPlan:
    return plan_output(req, "", max_guided_chars=1000, **kw)


def test_each_tool_choice_has_its_mode_and_constraint() -> None:
    assert plan(request()).mode == "auto"
    assert plan(request()).guided is None
    assert plan(request(tool_choice=common_pb2.ToolChoice(mode="none"))).mode == ""
    named = plan(request(tool_choice=common_pb2.ToolChoice(function_name="weather")))
    assert named.mode == "named"
    assert named.function == "weather"
    assert named.guided is not None
    assert json.loads(named.guided.json_schema) == json.loads(PARAMS)
    req = request(tool_choice=common_pb2.ToolChoice(mode="required"), parallel_tool_calls=False)
    required = plan(req)
    assert required.mode == "required"
    assert not required.parallel
    assert required.guided is not None
    assert json.loads(required.guided.json_schema)["maxItems"] == 1
    assert plan(request(), tool_parser="mistral").parser == "mistral"
    no_tools = gateway_pb2.GenerateRequest()
    assert not plan(no_tools).active
    assert plan(no_tools, reasoning="think").active


@pytest.mark.parametrize(
    ("req", "message"),
    [
        (request(tool_choice=common_pb2.ToolChoice(function_name="other")), "not in tools"),
        (request(tool_choice=common_pb2.ToolChoice(mode="sometimes")), "tool_choice must be"),
        (gateway_pb2.GenerateRequest(tool_choice=common_pb2.ToolChoice(mode="required")), "needs"),
        (
            gateway_pb2.GenerateRequest(
                tools=[common_pb2.Tool(function=common_pb2.FunctionDefinition(name="a b"))]
            ),
            "tools[0].function.name",
        ),
        (gateway_pb2.GenerateRequest(tools=[TOOLS[1], TOOLS[1]]), "appears twice"),
        (
            gateway_pb2.GenerateRequest(
                tools=[
                    common_pb2.Tool(
                        function=common_pb2.FunctionDefinition(name="a", parameters="[]")
                    )
                ]
            ),
            "tools[0].function.parameters",
        ),
        (
            gateway_pb2.GenerateRequest(
                tools=[
                    common_pb2.Tool(
                        function=common_pb2.FunctionDefinition(name="a", parameters="{" * 2000)
                    )
                ]
            ),
            "gateway.max_guided_chars",
        ),
        (
            request(
                tool_choice=common_pb2.ToolChoice(mode="required"),
                sampling=common_pb2.SamplingParams(
                    guided=common_pb2.GuidedDecoding(json_object=True)
                ),
            ),
            "cannot be combined",
        ),
    ],
)
def test_bad_tools_are_refused_naming_the_field(
    req: gateway_pb2.GenerateRequest, message: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        plan(req)


def shape(p: OutputPlan, deltas: list[str], finish: int = common_pb2.STOP) -> list[Chunk]:
    shaper = OutputShaper(p)
    chunks = [Chunk("r", text=d) for d in deltas]
    chunks[-1].finish_reason = finish
    return [shaper.apply(c) for c in chunks]


def merged(chunks: list[Chunk]) -> tuple[str, list[dict[str, str]], int]:
    """What a client builds from the deltas (the openai SDK's accumulation)."""
    calls: dict[int, dict[str, str]] = {}
    for c in chunks:
        for tc in c.tool_calls:
            call = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
            call["id"] += tc.id
            call["name"] += tc.name
            call["arguments"] += tc.arguments
    return "".join(c.text for c in chunks), list(calls.values()), chunks[-1].finish_reason


def test_auto_parses_calls_out_of_the_stream() -> None:
    text = 'Sure.<tool_call>{"name": "now", "arguments": {}}</tool_call>'
    content, calls, finish = merged(shape(plan(request()), [text[:9], text[9:30], text[30:]]))
    assert content == "Sure."
    assert finish == common_pb2.TOOL_CALLS
    assert [(c["name"], c["arguments"]) for c in calls] == [("now", "{}")]
    assert calls[0]["id"].startswith("call_")
    content, calls, finish = merged(shape(plan(request()), ["just text"]))
    assert (content, calls, finish) == ("just text", [], common_pb2.STOP)


def test_a_named_call_streams_its_arguments_as_they_come() -> None:
    p = plan(request(tool_choice=common_pb2.ToolChoice(function_name="weather")))
    chunks = shape(p, ['{"city"', ': "Paris"', "}"])
    first = chunks[0].tool_calls
    assert [(t.name, t.arguments) for t in first] == [("weather", ""), ("", '{"city"')]
    content, calls, finish = merged(chunks)
    assert content == ""
    assert finish == common_pb2.TOOL_CALLS
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("weather", {"city": "Paris"})
    ]
    _, _, finish = merged(shape(p, ['{"ci'], common_pb2.LENGTH))
    assert finish == common_pb2.LENGTH  # cut short: not a finished call


def test_required_turns_each_item_into_a_call() -> None:
    p = plan(request(tool_choice=common_pb2.ToolChoice(mode="required")))
    out = '[{"name": "weather", "parameters": {"city": "Oslo"}}, {"name": "now", "parameters": {}}]'
    content, calls, finish = merged(shape(p, [out[:20], out[20:]]))
    assert content == ""
    assert finish == common_pb2.TOOL_CALLS
    assert [c["name"] for c in calls] == ["weather", "now"]
    assert json.loads(calls[0]["arguments"]) == {"city": "Oslo"}
    content, calls, _ = merged(shape(p, ['[{"name": '], common_pb2.LENGTH))
    assert content == '[{"name": '
    assert calls == []


def test_parallel_false_keeps_the_first_call_and_reasoning_goes_apart() -> None:
    p = plan(request(parallel_tool_calls=False), reasoning="think")
    call = '<tool_call>{"name": "now", "arguments": {}}</tool_call>'
    chunks = shape(p, ["<think>hm", "m</think>", call + call])
    _, calls, _ = merged(chunks)
    assert len(calls) == 1
    assert "".join(c.reasoning_text for c in chunks) == "hmm"
