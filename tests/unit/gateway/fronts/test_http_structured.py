"""Structured outputs and tools on the HTTP front: OpenAI/vLLM fields -> llm.v1, 400s
naming the field, and tool call chunks as the official openai client accumulates them."""

from __future__ import annotations

import json
from typing import Any

import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from gateway.domain import Chunk
from gateway.fronts.http.errors import ApiError
from gateway.fronts.http.requests import parse
from gateway.fronts.http.responses import Formatter
from llm.v1 import common_pb2

MSGS = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TOOL = {
    "type": "function",
    "function": {"name": "weather", "description": "d", "parameters": SCHEMA},
}


def test_response_format_and_vllm_extras_become_the_constraint() -> None:
    def guided(**kw: Any) -> common_pb2.GuidedDecoding:
        return parse({"messages": MSGS, **kw}, chat=True).request.sampling.guided

    g = guided(
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": SCHEMA, "strict": True},
        }
    )
    assert json.loads(g.json_schema) == SCHEMA
    assert guided(response_format={"type": "json_object"}).json_object
    assert not parse(
        {"messages": MSGS, "response_format": {"type": "text"}}, chat=True
    ).request.sampling.HasField("guided")
    assert json.loads(guided(guided_json=json.dumps(SCHEMA)).json_schema) == SCHEMA
    assert guided(guided_regex="[0-9]+").regex == "[0-9]+"
    assert list(guided(guided_choice=["yes", "no"]).choice.choices) == ["yes", "no"]
    assert guided(structured_outputs={"grammar": 'root ::= "a"'}).grammar == 'root ::= "a"'
    prompt = parse({"prompt": "x", "guided_regex": "a+"}, chat=False).request
    assert prompt.sampling.guided.regex == "a+"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}},
            "response_format.json_schema.schema",
        ),
        ({"guided_choice": "yes"}, "guided_choice"),
        ({"structured_outputs": {"json": "{bad"}}, "structured_outputs.json"),
        ({"tools": [{"type": "function", "function": {"name": 3}}]}, "tools[0].function.name"),
        ({"tool_choice": {"type": "function"}}, "tool_choice"),
        ({"tool_choice": 1}, "tool_choice"),
        ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ],
)
def test_bad_fields_are_400s_naming_them(extra: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as info:
        parse({"messages": MSGS, **extra}, chat=True)
    assert info.value.status == 400
    assert info.value.param == param, info.value.message


def test_tools_and_the_tool_transcript_round_trip() -> None:
    body = {
        "messages": [
            *MSGS,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "weather", "arguments": '{"a": 1}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ],
        "tools": [TOOL],
        "tool_choice": {"type": "function", "function": {"name": "weather"}},
        "parallel_tool_calls": False,
    }
    req = parse(body, chat=True).request
    assert req.tools[0].function.name == "weather"
    assert json.loads(req.tools[0].function.parameters) == SCHEMA
    assert req.tool_choice.function_name == "weather"
    assert req.parallel_tool_calls is False
    call = req.messages.messages[1].tool_calls[0]
    assert (call.id, call.name, call.arguments) == ("call_1", "weather", '{"a": 1}')
    assert req.messages.messages[2].tool_call_id == "call_1"
    assert (
        parse(
            {"messages": MSGS, "tools": [TOOL], "tool_choice": "required"}, chat=True
        ).request.tool_choice.mode
        == "required"
    )


def chunks() -> list[Chunk]:
    usage = common_pb2.Usage(prompt_tokens=5, completion_tokens=9)
    return [
        Chunk("r", text="Checking.", reasoning_text="hmm", model="m"),
        Chunk(
            "r",
            tool_calls=[
                common_pb2.ToolCall(index=0, id="call_a", type="function", name="weather"),
                common_pb2.ToolCall(index=0, arguments='{"a": 1}'),
                common_pb2.ToolCall(index=1, id="call_b", type="function", name="weather"),
            ],
        ),
        Chunk(
            "r",
            tool_calls=[common_pb2.ToolCall(index=1, arguments='{"a": 2}')],
            finish_reason=common_pb2.TOOL_CALLS,
            usage=usage,
        ),
    ]


def test_streamed_tool_calls_accumulate_in_the_openai_client() -> None:
    parsed = parse({"messages": MSGS, "tools": [TOOL], "stream": True}, chat=True)
    fmt = Formatter(parsed, "rid", "m")
    state: ChatCompletionStreamState[Any] = ChatCompletionStreamState()
    objs = fmt.role_chunks() + [o for c in chunks() for o in fmt.stream_chunk(c)]
    for obj in objs:
        state.handle_chunk(ChatCompletionChunk.model_validate(obj))
    first_call = next(o for o in objs if o["choices"][0]["delta"].get("tool_calls"))
    assert first_call["choices"][0]["delta"]["tool_calls"][0]["function"] == {
        "name": "weather",
        "arguments": "",
    }
    assert [o["choices"][0]["finish_reason"] for o in objs].count("tool_calls") == 1
    done = state.get_final_completion()
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking."
    calls = choice.message.tool_calls or []
    assert [(c.id, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("call_a", "weather", {"a": 1}),
        ("call_b", "weather", {"a": 2}),
    ]


def test_the_whole_reply_carries_the_calls_and_the_thought() -> None:
    fmt = Formatter(parse({"messages": MSGS, "tools": [TOOL]}, chat=True), "rid", "m")
    for c in chunks():
        fmt.add(c)
    body = fmt.final()
    message = body["choices"][0]["message"]
    assert message["reasoning_content"] == "hmm"
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    done = ChatCompletion.model_validate(body)
    calls = done.choices[0].message.tool_calls or []
    assert [c.function.arguments for c in calls if c.type == "function"] == [
        '{"a": 1}',
        '{"a": 2}',
    ]
