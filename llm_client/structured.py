"""llm-client chat's structured outputs and tools.

    llm-client chat "Name a city as JSON" --json-schema city.schema.json
    llm-client chat "A date" --regex '[0-9]{4}-[0-9]{2}-[0-9]{2}'
    llm-client chat "Weather in Paris?" --tool weather.json --tool-choice required

``--tool FILE`` (repeatable) is one OpenAI tool definition
(``{"type": "function", "function": {"name", "description", "parameters"}}``, or just
the ``function`` object); ``--tool-choice`` is auto, none, required or a function's
name. The calls the model makes are printed after the text, one per line:
``[tool call <id>] <name>(<arguments>)``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from llm.v1 import common_pb2, gateway_pb2

MODES = ("auto", "none", "required")


def add_args(g: argparse.ArgumentParser) -> None:
    """The chat subcommand's flags."""
    g.add_argument("--json-schema", metavar="FILE", help="constrain the reply to this JSON Schema")
    g.add_argument("--json-object", action="store_true", help="constrain the reply to JSON")
    g.add_argument("--regex", help="constrain the reply to this regular expression")
    g.add_argument(
        "--tool",
        metavar="FILE",
        action="append",
        help="a JSON file holding one OpenAI tool definition (repeatable)",
    )
    g.add_argument(
        "--tool-choice",
        default="",
        help="auto (default with tools), none, required, or the name of a function to call",
    )
    g.add_argument(
        "--no-parallel-tool-calls", action="store_true", help="at most one tool call per turn"
    )


def _load(path: str) -> Any:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: cannot read JSON from {path}: {e}") from None


def tool(path: str) -> common_pb2.Tool:
    """One tool definition from a file."""
    obj = _load(path)
    fn = obj.get("function", obj) if isinstance(obj, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise SystemExit(f"error: {path} is not a tool definition (a function with a name)")
    params = fn.get("parameters")
    return common_pb2.Tool(
        type="function",
        function=common_pb2.FunctionDefinition(
            name=fn["name"],
            description=str(fn.get("description", "")),
            parameters=json.dumps(params) if params is not None else "",
            strict=bool(fn.get("strict")),
        ),
    )


def apply(req: gateway_pb2.GenerateRequest, args: argparse.Namespace) -> None:
    """Put the flags' constraint and tools into ``req``."""
    given = [f for f in ("json_schema", "json_object", "regex") if getattr(args, f, None)]
    if len(given) > 1:
        raise SystemExit(
            f"error: --{given[0].replace('_', '-')} and "
            f"--{given[1].replace('_', '-')} both constrain the reply: pick one"
        )
    if getattr(args, "json_schema", None):
        schema = _load(args.json_schema)
        req.sampling.guided.json_schema = json.dumps(schema)
    elif getattr(args, "json_object", False):
        req.sampling.guided.json_object = True
    elif getattr(args, "regex", None):
        req.sampling.guided.regex = args.regex
    for path in getattr(args, "tool", None) or []:
        req.tools.append(tool(path))
    choice = getattr(args, "tool_choice", "")
    if choice in MODES:
        req.tool_choice.mode = choice
    elif choice:
        req.tool_choice.function_name = choice
    if getattr(args, "no_parallel_tool_calls", False):
        req.parallel_tool_calls = False


class CallPrinter:
    """Merges streamed tool call deltas; ``lines`` are the finished calls."""

    def __init__(self) -> None:
        self.calls: dict[int, list[str]] = {}

    def add(self, chunk: gateway_pb2.GenerateResponse) -> None:
        """Record one chunk's deltas."""
        for tc in chunk.tool_calls:
            call = self.calls.setdefault(tc.index, ["", "", ""])
            call[0] = tc.id or call[0]
            call[1] += tc.name
            call[2] += tc.arguments

    def lines(self) -> list[str]:
        """``[tool call <id>] <name>(<arguments>)`` per call, in order (the arguments on
        one line: compact JSON where they parse)."""
        return [
            f"[tool call {i}] {n}({_compact(a)})" for _, (i, n, a) in sorted(self.calls.items())
        ]


def _compact(arguments: str) -> str:
    try:
        return json.dumps(json.loads(arguments), ensure_ascii=False)
    except ValueError:
        return arguments.replace("\n", " ")
