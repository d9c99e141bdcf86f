"""Chat messages and tools of an EncodeRequest -> what the chat template renders.

A template that reads ``tools`` gets them, and the assistant turns' calls, as
transformers passes them. A template that does not (SmolLM2's) gets the default
rendering, Hermes style, in plain messages:

    system  <its content>

            # Tools
            ... one function per line, as JSON, inside <tools></tools> ...
            ... how to call: <tool_call>{"name": ..., "arguments": {...}}</tool_call>
    assistant (with calls)  <content>\\n<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>
    tool                    user: <tool_response>\\n<content>\\n</tool_response>

so the gateway's Hermes parser (``gateway.request.tool_parsers``) reads the calls back.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from llm.v1 import common_pb2
from tokenizer_svc.chat_template import ChatTemplate, Message

TOOLS_HEADER = (
    "# Tools\n\n"
    "You may call the functions below to help with the request. Each line inside "
    "<tools></tools> describes one function as JSON:\n<tools>\n"
)
TOOLS_FOOTER = (
    "\n</tools>\n\n"
    "To call a function, answer with one block per call, each a JSON object holding "
    "the function's name and its arguments:\n"
    '<tool_call>\n{"name": "<function name>", "arguments": {<the arguments>}}\n</tool_call>'
)


def _arguments(text: str) -> Any:
    """A call's arguments as an object where they parse (templates index into them)."""
    try:
        return json.loads(text) if text else {}
    except ValueError:
        return text


def tool_json(tool: common_pb2.Tool) -> dict[str, Any]:
    """One tool as the OpenAI/transformers object (parameters decoded)."""
    fn: dict[str, Any] = {"name": tool.function.name}
    if tool.function.description:
        fn["description"] = tool.function.description
    fn["parameters"] = _arguments(tool.function.parameters) or {"type": "object", "properties": {}}
    return {"type": "function", "function": fn}


def _call_json(call: common_pb2.ToolCall) -> dict[str, Any]:
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": _arguments(call.arguments)},
    }


def _default_call(call: common_pb2.ToolCall) -> str:
    body = json.dumps({"name": call.name, "arguments": _arguments(call.arguments)})
    return f"<tool_call>\n{body}\n</tool_call>"


def tools_section(tools: Sequence[common_pb2.Tool]) -> str:
    """The default system-prompt section listing ``tools``."""
    lines = "\n".join(json.dumps(tool_json(t), ensure_ascii=False) for t in tools)
    return TOOLS_HEADER + lines + TOOLS_FOOTER


def _default(
    messages: Sequence[common_pb2.ChatMessage], tools: Sequence[common_pb2.Tool]
) -> list[Message]:
    out: list[Message] = []
    for m in messages:
        if m.role == "tool":
            out.append(Message("user", f"<tool_response>\n{m.content}\n</tool_response>"))
        elif m.role == "assistant" and m.tool_calls:
            calls = "\n".join(_default_call(c) for c in m.tool_calls)
            out.append(Message("assistant", f"{m.content}\n{calls}" if m.content else calls))
        else:
            out.append(Message(m.role, m.content))
    if tools:
        section = tools_section(tools)
        if out and out[0].role == "system":
            out[0] = Message("system", f"{out[0].content}\n\n{section}")
        else:
            out.insert(0, Message("system", section))
    return out


def chat_input(
    template: ChatTemplate | None,
    messages: Sequence[common_pb2.ChatMessage],
    tools: Sequence[common_pb2.Tool],
) -> tuple[list[Message], list[dict[str, Any]] | None]:
    """The template's messages and tools for one request (see the module docstring)."""
    uses_tools = bool(tools) or any(m.tool_calls or m.role == "tool" for m in messages)
    if template is not None and uses_tools and not template.supports_tools:
        return _default(messages, tools), None
    msgs = [
        Message(
            m.role,
            m.content,
            tuple(_call_json(c) for c in m.tool_calls),
            m.tool_call_id,
            m.name,
        )
        for m in messages
    ]
    return msgs, [tool_json(t) for t in tools] or None


def tools_chars(tools: Sequence[common_pb2.Tool]) -> int:
    """Characters the tools add to a request (for size checks before rendering)."""
    return sum(
        len(t.function.name) + len(t.function.description) + len(t.function.parameters)
        for t in tools
    )
