"""Guided (constrained) decoding: checks of ``SamplingParams.guided``, and the constraint a
tool choice implies.

The engine compiles and applies the constraint (a token mask per step); the gateway only
bounds what it forwards: each constraint's text is at most ``gateway.max_guided_chars``
characters, a JSON schema must be a JSON object (or ``true``), a choice list non-empty.
A message names the field (``sampling.guided.<kind>``), which the HTTP front reports as
``response_format``.

Tool choices that must call a tool are enforced the way vLLM does, with a JSON schema:

    {"type": "function", "function": {"name": F}}   the output is F's arguments
                                                    (F's parameters schema)
    "required"                                      [{"name": <enum of the tools>,
                                                      "parameters": <that tool's schema>}, ...]
                                                    minItems 1 (maxItems 1 when
                                                    parallel_tool_calls is false)
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from llm.v1 import common_pb2

DEFAULT_MAX_GUIDED_CHARS = 65_536
MAX_CHOICES = 256
ANY_OBJECT: dict[str, Any] = {"type": "object"}


def check_guided(g: common_pb2.GuidedDecoding, max_chars: int) -> None:
    """Bound one constraint's size and shape.

    Raises:
        ValueError: naming ``sampling.guided.<kind>``.
    """
    kind = g.WhichOneof("constraint")
    if kind is None or kind == "json_object":
        return
    field = f"sampling.guided.{kind}"
    if kind == "choice":
        choices = list(g.choice.choices)
        if not choices or len(choices) > MAX_CHOICES:
            raise ValueError(f"{field} must list 1 to {MAX_CHOICES} strings, got {len(choices)}")
        size = sum(len(c) for c in choices)
    else:
        text = getattr(g, kind)
        if not text:
            raise ValueError(f"{field} is empty")
        size = len(text)
    if size > max_chars:
        raise ValueError(
            f"{field} is {size} characters; this gateway accepts at most {max_chars} "
            "(gateway.max_guided_chars)"
        )
    if kind in ("json_schema", "structural_tag"):
        try:
            value = json.loads(g.json_schema if kind == "json_schema" else g.structural_tag)
        except ValueError as e:
            raise ValueError(f"{field} is not valid JSON: {e}") from None
        if kind == "json_schema" and not (isinstance(value, dict) or value is True):
            raise ValueError(f"{field} must be a JSON Schema object")


def parameters_schema(tool: common_pb2.Tool) -> dict[str, Any]:
    """A tool's parameters as a JSON Schema object (empty = any object)."""
    text = tool.function.parameters
    value = json.loads(text) if text else ANY_OBJECT
    return value if isinstance(value, dict) and value else ANY_OBJECT


def named_call(tool: common_pb2.Tool) -> common_pb2.GuidedDecoding:
    """The constraint of ``tool_choice`` naming ``tool``: its arguments, nothing else."""
    return common_pb2.GuidedDecoding(json_schema=json.dumps(parameters_schema(tool)))


def required_calls(tools: Sequence[common_pb2.Tool], parallel: bool) -> common_pb2.GuidedDecoding:
    """The constraint of ``tool_choice: required``: a JSON array of calls."""
    items = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [t.function.name]},
                "parameters": parameters_schema(t),
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": items[0] if len(items) == 1 else {"anyOf": items},
    }
    if not parallel:
        schema["maxItems"] = 1
    return common_pb2.GuidedDecoding(json_schema=json.dumps(schema))
