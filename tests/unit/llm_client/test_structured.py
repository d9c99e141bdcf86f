"""llm-client chat's --json-schema / --regex / --tool / --tool-choice flags into the request,
and the tool calls it prints from streamed deltas."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llm.v1 import common_pb2, gateway_pb2
from llm_client.cli import parser
from llm_client.structured import CallPrinter, apply


def request(argv: list[str]) -> gateway_pb2.GenerateRequest:
    req = gateway_pb2.GenerateRequest()
    apply(req, parser().parse_args(["chat", "hi", *argv]))
    return req


def test_flags_become_the_constraint_and_tools(tmp_path: Path) -> None:
    schema = tmp_path / "s.json"
    schema.write_text('{"type": "object", "properties": {"a": {"type": "integer"}}}')
    req = request(["--json-schema", str(schema)])
    assert json.loads(req.sampling.guided.json_schema)["properties"] == {"a": {"type": "integer"}}
    assert request(["--regex", "[0-9]+"]).sampling.guided.regex == "[0-9]+"
    weather = tmp_path / "w.json"
    weather.write_text(json.dumps({"type": "function", "function": {"name": "weather"}}))
    now = tmp_path / "n.json"
    now.write_text(json.dumps({"name": "now", "parameters": {"type": "object"}}))
    req = request(["--tool", str(weather), "--tool", str(now), "--tool-choice", "now"])
    assert [t.function.name for t in req.tools] == ["weather", "now"]
    assert req.tools[1].function.parameters == '{"type": "object"}'
    assert req.tool_choice.function_name == "now"
    req = request(["--tool", str(weather), "--tool-choice", "required", "--no-parallel-tool-calls"])
    assert req.tool_choice.mode == "required"
    assert req.parallel_tool_calls is False


def test_bad_flags_exit_with_a_message(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("[1]")
    with pytest.raises(SystemExit, match="not a tool definition"):
        request(["--tool", str(bad)])
    with pytest.raises(SystemExit, match="both constrain"):
        request(["--regex", "a", "--json-object"])
    with pytest.raises(SystemExit, match="cannot read JSON"):
        request(["--json-schema", str(tmp_path / "missing.json")])


def test_streamed_deltas_print_as_whole_calls() -> None:
    p = CallPrinter()
    p.add(
        gateway_pb2.GenerateResponse(
            tool_calls=[
                common_pb2.ToolCall(index=0, id="call_1", type="function", name="weather"),
                common_pb2.ToolCall(index=0, arguments='{"city": '),
            ]
        )
    )
    p.add(
        gateway_pb2.GenerateResponse(
            tool_calls=[common_pb2.ToolCall(index=0, arguments='\n  "Oslo"}')]
        )
    )
    assert p.lines() == ['[tool call call_1] weather({"city": "Oslo"})']
