"""Tool calling through the gateway with the official ``openai`` client (HTTP front) and
over gRPC, on the session's real engines: a named function and ``required`` (enforced by
guided decoding, so even the small model calls), ``auto`` (whatever it answers parses),
streamed and not, a tool result round trip, and the tools counted in the prompt."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam
from pydantic import BaseModel, Field

from llm.v1 import common_pb2, gateway_pb2
from llm_client import cli
from tests.integration.gateway.conftest import HttpGateway, chat

pytestmark = pytest.mark.integration


class GetWeather(BaseModel):
    """The weather now in a city."""

    city: str = Field(max_length=16)


class GetTime(BaseModel):
    """The local time in a timezone."""

    timezone: str = Field(max_length=16)


TOOLS: list[ChatCompletionToolParam] = [
    openai.pydantic_function_tool(GetWeather),
    openai.pydantic_function_tool(GetTime),
]
ASK: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Weather in Paris?"}]


def test_a_named_function_is_called_with_arguments_that_fit(client: openai.OpenAI) -> None:
    done = client.chat.completions.parse(
        model="",
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "GetWeather"}},
        max_tokens=48,
        temperature=0.8,
        seed=1,
    )
    (choice,) = done.choices
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls or []
    assert call.id.startswith("call_")
    assert call.function.name == "GetWeather"
    assert isinstance(call.function.parsed_arguments, GetWeather)


def test_required_streams_calls_the_client_assembles(client: openai.OpenAI) -> None:
    with client.chat.completions.stream(
        model="",
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=64,
        temperature=0.8,
        seed=2,
    ) as stream:
        events = [e.type for e in stream]
        done = stream.get_final_completion()
    assert "tool_calls.function.arguments.done" in events
    (choice,) = done.choices
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls or []  # parallel_tool_calls false: one call
    assert call.function.name in ("GetWeather", "GetTime")
    assert isinstance(call.function.parsed_arguments, GetWeather | GetTime)


@pytest.mark.parametrize("stream", [False, True])
def test_auto_answers_parse_either_way(client: openai.OpenAI, stream: bool) -> None:
    kwargs: dict[str, Any] = {
        "model": "",
        "messages": ASK,
        "tools": TOOLS,
        "max_tokens": 24,
        "temperature": 0,
    }
    content, calls = "", dict[int, str]()
    if stream:
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            delta = chunk.choices[0].delta
            content += delta.content or ""
            for tc in delta.tool_calls or []:
                calls[tc.index] = calls.get(tc.index, "") + (tc.function.arguments or "")
    else:
        message = client.chat.completions.create(**kwargs).choices[0].message
        content = message.content or ""
        calls = dict(enumerate(c.function.arguments for c in message.tool_calls or []))
    assert content or calls
    for arguments in calls.values():
        json.loads(arguments)


def test_a_tool_result_round_trips_and_tools_count_in_the_prompt(client: openai.OpenAI) -> None:
    messages: list[ChatCompletionMessageParam] = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "GetWeather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"celsius": 21}'},
    ]
    plain = client.chat.completions.create(model="", messages=ASK, max_tokens=4, temperature=0)
    turn = client.chat.completions.create(
        model="", messages=messages, tools=TOOLS, tool_choice="none", max_tokens=16, temperature=0
    )
    assert turn.choices[0].message.content
    assert not turn.choices[0].message.tool_calls  # "none": nothing is read as a call
    assert plain.usage is not None
    assert turn.usage is not None
    assert turn.usage.prompt_tokens > plain.usage.prompt_tokens + 60  # tools + transcript


def test_bad_tool_choices_are_400s_naming_the_field(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="",
            messages=ASK,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "Nope"}},
            max_tokens=4,
        )
    assert info.value.body["param"] == "tool_choice"  # type: ignore[index]
    assert "Nope" in info.value.message


def test_grpc_carries_tool_call_deltas_and_finish_reason(http_gateway: HttpGateway) -> None:
    gw = http_gateway.gw
    _, key = gw.tenant()
    req = chat("Weather in Oslo?", max_tokens=48, temperature=0.5, seed=4)
    req.tools.add(
        type="function",
        function=common_pb2.FunctionDefinition(
            name="GetWeather", parameters=json.dumps(GetWeather.model_json_schema())
        ),
    )
    req.tool_choice.function_name = "GetWeather"
    chunks: list[gateway_pb2.GenerateResponse] = gw.generate(key, req)
    deltas = [tc for c in chunks for tc in c.tool_calls]
    assert deltas[0].name == "GetWeather"
    assert deltas[0].id.startswith("call_")
    assert deltas[0].arguments == ""
    assert all(d.index == 0 and not d.name for d in deltas[1:])
    assert "".join(c.text for c in chunks) == ""
    assert chunks[-1].finish_reason == common_pb2.TOOL_CALLS
    GetWeather.model_validate_json("".join(d.arguments for d in deltas))


def test_llm_client_prints_the_call(
    http_gateway: HttpGateway, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, key = http_gateway.gw.tenant()
    tool = tmp_path / "weather.json"
    tool.write_text(json.dumps(TOOLS[0]))
    argv = ["--plaintext", "--address", http_gateway.gw.proc.address, "--api-key", key]
    chat_args = ["chat", "Weather in Oslo?", "--tool", str(tool), "--tool-choice", "GetWeather"]
    assert cli.main([*argv, *chat_args, "--max-tokens", "48", "--seed", "4"]) == 0
    out, err = capsys.readouterr()
    line = next(x for x in out.splitlines() if x.startswith("[tool call call_"))
    name, _, args = line.split("] ", 1)[1].partition("(")
    assert name == "GetWeather"
    GetWeather.model_validate_json(args[:-1])
    assert "[TOOL_CALLS]" in err
