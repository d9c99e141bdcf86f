"""OpenAI's structured-output and tool fields -> ``llm.v1`` (400s name the field).

    response_format {"type": "json_object"}                     guided.json_object
    response_format {"type": "json_schema", "json_schema":
                     {"name", "schema", "strict"}}              guided.json_schema
    guided_json / guided_regex / guided_choice / guided_grammar (vLLM's extras), or
    structured_outputs {"json" | "regex" | "choice" | "grammar"} guided.<the one given>
    tools [{"type": "function", "function": {name, description, parameters, strict}}]
    tool_choice "auto" | "none" | "required" | {"type": "function", "function": {"name"}}
    parallel_tool_calls                                          bool
    messages[i].tool_calls / tool_call_id / name                 ChatMessage fields

Sizes and names are checked by the pipeline (``gateway.request.tools``), for gRPC
callers alike.
"""

from __future__ import annotations

import json
from typing import Any

from gateway.fronts.http.errors import ApiError
from gateway.fronts.http.fields import Fields
from llm.v1 import common_pb2, gateway_pb2

_EXTRAS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def _json_text(value: Any, param: str) -> str:
    """A schema given as an object (or as JSON text) -> JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise ApiError.invalid(param, f"{param} is not valid JSON") from None
    if not isinstance(value, dict | bool):
        raise ApiError.invalid(param, f"{param} must be a JSON Schema object")
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _guided(kind: str, value: Any, param: str) -> common_pb2.GuidedDecoding:
    if kind == "json":
        return common_pb2.GuidedDecoding(json_schema=_json_text(value, param))
    if kind == "choice":
        if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
            raise ApiError.invalid(param, f"{param} must be a list of strings")
        return common_pb2.GuidedDecoding(choice=common_pb2.ChoiceList(choices=value))
    text = Fields.typed(value, str, param)
    if kind == "regex":
        return common_pb2.GuidedDecoding(regex=text)
    return common_pb2.GuidedDecoding(grammar=text)


def _response_format(f: Fields) -> common_pb2.GuidedDecoding | None:
    fmt = f.body.get("response_format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise ApiError.invalid("response_format", "response_format must be an object")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return common_pb2.GuidedDecoding(json_object=True)
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise ApiError.invalid(
                "response_format.json_schema",
                "response_format.json_schema must be an object {name, schema, strict}",
            )
        Fields.typed(spec.get("name", ""), str, "response_format.json_schema.name")
        schema = spec.get("schema")
        if schema is None:
            schema = {"type": "object"}  # OpenAI: no schema = any JSON object
        return common_pb2.GuidedDecoding(
            json_schema=_json_text(schema, "response_format.json_schema.schema")
        )
    raise ApiError.invalid(
        "response_format.type",
        f'response_format.type must be "text", "json_object" or "json_schema", got {kind!r}',
    )


def guided(f: Fields) -> common_pb2.GuidedDecoding | None:
    """The request's one constraint, from whichever field gives it.

    Raises:
        ApiError: a malformed field, or two fields that both constrain.
    """
    found: list[tuple[str, common_pb2.GuidedDecoding]] = []
    fmt = _response_format(f)
    if fmt is not None:
        found.append(("response_format", fmt))
    for name, kind in _EXTRAS.items():
        if f.body.get(name) is not None:
            found.append((name, _guided(kind, f.body[name], name)))
    so = f.body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise ApiError.invalid("structured_outputs", "structured_outputs must be an object")
        for kind in ("json", "regex", "choice", "grammar"):
            if so.get(kind) is not None:
                param = f"structured_outputs.{kind}"
                found.append((param, _guided(kind, so[kind], param)))
    if len(found) > 1:
        raise ApiError.invalid(
            found[1][0],
            f"{found[0][0]} and {found[1][0]} both constrain the output: send one of them",
        )
    return found[0][1] if found else None


def tools(f: Fields, req: gateway_pb2.GenerateRequest) -> None:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` into ``req``."""
    raw = f.body.get("tools")
    if raw is not None:
        if not isinstance(raw, list):
            raise ApiError.invalid("tools", "tools must be a list of function tools")
        for i, t in enumerate(raw):
            fn = t.get("function") if isinstance(t, dict) else None
            if not isinstance(fn, dict):
                raise ApiError.invalid(
                    f"tools[{i}]", f'tools[{i}] must be {{"type": "function", "function": {{...}}}}'
                )
            params = fn.get("parameters")
            req.tools.add(
                type=Fields.typed(t.get("type", "function"), str, f"tools[{i}].type"),
                function=common_pb2.FunctionDefinition(
                    name=Fields.typed(fn.get("name"), str, f"tools[{i}].function.name"),
                    description=Fields.typed(
                        fn.get("description") or "", str, f"tools[{i}].function.description"
                    ),
                    parameters=""
                    if params is None
                    else _json_text(params, f"tools[{i}].function.parameters"),
                    strict=bool(fn.get("strict")),
                ),
            )
    choice = f.body.get("tool_choice")
    if isinstance(choice, str):
        req.tool_choice.mode = choice
    elif isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise ApiError.invalid(
                "tool_choice",
                'tool_choice must be "auto", "none", "required" or '
                '{"type": "function", "function": {"name": ...}}',
            )
        req.tool_choice.function_name = name
    elif choice is not None:
        raise ApiError.invalid("tool_choice", "tool_choice must be a string or an object")
    if f.body.get("parallel_tool_calls") is not None:
        req.parallel_tool_calls = f.bool_("parallel_tool_calls")


def tool_calls(raw: Any, param: str) -> list[common_pb2.ToolCall]:
    """An assistant message's ``tool_calls``."""
    if not isinstance(raw, list):
        raise ApiError.invalid(param, f"{param} must be a list")
    out = []
    for i, c in enumerate(raw):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict):
            raise ApiError.invalid(f"{param}[{i}]", f"{param}[{i}] must be a function call")
        args = fn.get("arguments", "")
        if isinstance(args, dict):
            args = json.dumps(args, ensure_ascii=False)
        out.append(
            common_pb2.ToolCall(
                index=i,
                id=Fields.typed(c.get("id", ""), str, f"{param}[{i}].id"),
                type="function",
                name=Fields.typed(fn.get("name"), str, f"{param}[{i}].function.name"),
                arguments=Fields.typed(args, str, f"{param}[{i}].function.arguments"),
            )
        )
    return out
