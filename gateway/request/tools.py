"""Tool calling and reasoning for every front: the request's tools checked, the constraint
a tool choice implies, and the output shaped into content, calls and thought.

    tool_choice          prompt            constraint              output
    (none given) / auto  tools rendered    none                    the model family's parser
                                                                   (gateway.request.tool_parsers)
    none                 tools rendered    none                    content only
    required             tools rendered    JSON array of calls     each item one call
    {"function": F}      tools rendered    F's parameters          the whole output: F's arguments

The prompt side is the chat template's (tokenizer_svc.tool_prompt); here the output is
shaped chunk by chunk (``OutputShaper.apply``), so the fronts only format: a call's first
delta carries index, id, type and name with empty arguments, the next one its arguments,
and a turn that made calls ends with finish reason TOOL_CALLS.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field

from gateway.domain import Chunk
from gateway.request.guided import check_guided, named_call, required_calls
from gateway.request.reasoning import ThinkSplitter
from gateway.request.tool_parsers import PARSERS, Call, ToolParser, as_call, parser_for_template
from llm.v1 import common_pb2, gateway_pb2

MAX_TOOLS = 128
NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
MODES = ("auto", "none", "required")
_WHOLE_ENDS = (common_pb2.STOP, common_pb2.LENGTH)


@dataclass(slots=True)
class OutputPlan:
    """How one request's output is read.

    Attributes:
        mode: "" (no calls are read), "auto", "named" or "required".
        parser: The tool parser of "auto" (a ``tool_parsers.PARSERS`` name).
        function: The function of "named".
        parallel: More than one call may be made.
        reasoning: The reasoning parser ("" = none).
        guided: The constraint the tool choice implies (None = none).
    """

    mode: str = ""
    parser: str = "hermes"
    function: str = ""
    parallel: bool = True
    reasoning: str = ""
    guided: common_pb2.GuidedDecoding | None = None

    @property
    def active(self) -> bool:
        """True when the output needs shaping at all."""
        return bool(self.mode or self.reasoning)


def check_tools(tools: list[common_pb2.Tool], max_chars: int) -> None:
    """Names, types and parameter schemas of the request's tools.

    Raises:
        ValueError: naming ``tools[i]...``.
    """
    if len(tools) > MAX_TOOLS:
        raise ValueError(f"tools has {len(tools)} entries; at most {MAX_TOOLS} are allowed")
    seen: set[str] = set()
    for i, t in enumerate(tools):
        if t.type not in ("", "function"):
            raise ValueError(f'tools[{i}].type must be "function", got {t.type!r}')
        name = t.function.name
        if not NAME.fullmatch(name):
            raise ValueError(
                f"tools[{i}].function.name must be 1-64 letters, digits, _ or -, got {name!r}"
            )
        if name in seen:
            raise ValueError(f"tools[{i}].function.name {name!r} appears twice")
        seen.add(name)
        params = t.function.parameters
        if len(params) > max_chars:
            raise ValueError(
                f"tools[{i}].function.parameters is {len(params)} characters; this gateway "
                f"accepts at most {max_chars} (gateway.max_guided_chars)"
            )
        if params:
            try:
                value = json.loads(params)
            except ValueError as e:
                raise ValueError(f"tools[{i}].function.parameters is not valid JSON: {e}") from None
            if not isinstance(value, dict):
                raise ValueError(f"tools[{i}].function.parameters must be a JSON Schema object")


def plan_output(
    request: gateway_pb2.GenerateRequest,
    template_source: str,
    *,
    tool_parser: str = "",
    reasoning: str = "",
    max_guided_chars: int,
) -> OutputPlan:
    """The request's plan; ``tool_parser`` "" = the one the template implies.

    Raises:
        ValueError: a bad tool, tool choice or constraint, naming the field.
    """
    tools = list(request.tools)
    check_tools(tools, max_guided_chars)
    if request.sampling.HasField("guided"):
        check_guided(request.sampling.guided, max_guided_chars)
    plan = OutputPlan(
        parser=tool_parser or parser_for_template(template_source),
        parallel=request.parallel_tool_calls if request.HasField("parallel_tool_calls") else True,
        reasoning=reasoning,
    )
    choice = request.tool_choice
    kind = choice.WhichOneof("choice") if request.HasField("tool_choice") else None
    mode = choice.mode if kind == "mode" else ("named" if kind == "function_name" else "")
    if kind == "mode" and mode not in MODES:
        raise ValueError(
            f'tool_choice must be "auto", "none", "required" or a function, got {mode!r}'
        )
    if mode and mode != "none" and not tools:
        raise ValueError(f"tool_choice {mode!r} needs tools: list the functions in tools")
    if not tools or mode == "none":
        return plan
    plan.mode = mode or "auto"
    if plan.mode == "named":
        match = [t for t in tools if t.function.name == choice.function_name]
        if not match:
            raise ValueError(
                f"tool_choice names function {choice.function_name!r}, which is not in tools"
            )
        plan.function, plan.guided = choice.function_name, named_call(match[0])
    elif plan.mode == "required":
        plan.guided = required_calls(tools, plan.parallel)
    if plan.guided is not None and request.sampling.HasField("guided"):
        raise ValueError(
            f"tool_choice {plan.mode!r} constrains the output itself; it cannot be combined "
            "with sampling.guided (response_format)"
        )
    return plan


def _call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass(slots=True)
class OutputShaper:
    """Shapes one request's chunks by its plan (one shaper per request)."""

    plan: OutputPlan
    _parser: ToolParser | None = None
    _think: ThinkSplitter | None = None
    _buf: list[str] = field(default_factory=list)
    _ends: tuple[int, ...] = ()
    num_calls: int = 0

    def __post_init__(self) -> None:
        if self.plan.mode == "auto":
            self._parser = PARSERS[self.plan.parser]()
        if self.plan.reasoning:
            self._think = ThinkSplitter()
        # the finish reasons a turn with calls reports as TOOL_CALLS: parsed calls are
        # whole even when the output ran on to max_tokens; a named call's arguments are
        # cut there
        self._ends = (common_pb2.STOP,) if self.plan.mode == "named" else _WHOLE_ENDS

    def apply(self, chunk: Chunk) -> Chunk:
        """Move the chunk's text into content, reasoning and tool call deltas."""
        text, last = chunk.text, bool(chunk.finish_reason)
        if self._think is not None:
            thought, text = self._think.feed(text)
            if last:
                more, rest = self._think.finish()
                thought, text = thought + more, text + rest
            chunk.reasoning_text = thought
        content, calls = self._content(text, last)
        chunk.text = content
        chunk.tool_calls = self._deltas(calls)
        if last and self.num_calls and chunk.finish_reason in self._ends:
            chunk.finish_reason = common_pb2.TOOL_CALLS
        return chunk

    def _content(self, text: str, last: bool) -> tuple[str, list[Call]]:
        mode = self.plan.mode
        if self._parser is not None:
            content, calls = self._parser.feed(text)
            if last:
                more, more_calls = self._parser.finish()
                content, calls = content + more, calls + more_calls
            return content, calls
        if mode == "named":
            return "", ([(self.plan.function, text)] if text else [])
        if mode == "required":
            self._buf.append(text)
            return ("", []) if not last else self._array("".join(self._buf))
        return text, []

    @staticmethod
    def _array(text: str) -> tuple[str, list[Call]]:
        try:
            items = json.loads(text)
        except ValueError:
            return text, []
        if not isinstance(items, list):
            return text, []
        calls = [as_call(v, ("parameters", "arguments")) for v in items]
        if not calls or any(c is None for c in calls):
            return text, []
        return "", [c for c in calls if c is not None]

    def _deltas(self, calls: list[Call]) -> list[common_pb2.ToolCall]:
        out: list[common_pb2.ToolCall] = []
        for name, args in calls:
            if self.plan.mode == "named" and self.num_calls:  # the one call goes on
                out.append(common_pb2.ToolCall(index=0, arguments=args))
                continue
            if self.num_calls and not self.plan.parallel:
                continue  # parallel_tool_calls false: the first call only
            index = self.num_calls
            self.num_calls += 1
            out.append(
                common_pb2.ToolCall(
                    index=index, id=_call_id(), type="function", name=name, arguments=""
                )
            )
            if args:
                out.append(common_pb2.ToolCall(index=index, arguments=args))
        return out
