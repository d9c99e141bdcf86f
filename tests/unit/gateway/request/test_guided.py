"""Guided-decoding checks and the constraints tool choices imply (checked with a JSON
Schema validator: what they accept is exactly the calls they stand for)."""

from __future__ import annotations

import json

import jsonschema  # type: ignore[import-untyped]
import pytest

from gateway.request.guided import check_guided, named_call, required_calls
from llm.v1 import common_pb2

WEATHER = common_pb2.Tool(
    type="function",
    function=common_pb2.FunctionDefinition(
        name="weather",
        parameters=json.dumps(
            {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
        ),
    ),
)
NOW = common_pb2.Tool(type="function", function=common_pb2.FunctionDefinition(name="now"))


@pytest.mark.parametrize(
    ("guided", "message"),
    [
        (common_pb2.GuidedDecoding(json_schema="x" * 11), "at most 10"),
        (common_pb2.GuidedDecoding(json_schema="{not json"), "not valid JSON"),
        (common_pb2.GuidedDecoding(json_schema="[1]"), "JSON Schema object"),
        (common_pb2.GuidedDecoding(regex=""), "sampling.guided.regex is empty"),
        (common_pb2.GuidedDecoding(choice=common_pb2.ChoiceList()), "1 to 256"),
        (
            common_pb2.GuidedDecoding(choice=common_pb2.ChoiceList(choices=["abcdef"] * 2)),
            "sampling.guided.choice is 12 characters",
        ),
    ],
)
def test_bad_constraints_are_refused_naming_the_field(
    guided: common_pb2.GuidedDecoding, message: str
) -> None:
    with pytest.raises(ValueError, match=r"sampling\.guided") as info:
        check_guided(guided, 10)
    assert message in str(info.value)


def test_good_constraints_pass() -> None:
    for g in (
        common_pb2.GuidedDecoding(json_object=True),
        common_pb2.GuidedDecoding(json_schema='{"type":"object"}'),
        common_pb2.GuidedDecoding(json_schema="true"),
        common_pb2.GuidedDecoding(regex="[0-9]+"),
        common_pb2.GuidedDecoding(),
    ):
        check_guided(g, 100)


def test_a_named_function_constrains_to_its_arguments() -> None:
    schema = json.loads(named_call(WEATHER).json_schema)
    jsonschema.validate({"city": "Paris"}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({}, schema)
    assert json.loads(named_call(NOW).json_schema) == {"type": "object"}


def test_required_constrains_to_a_list_of_calls_of_the_tools() -> None:
    schema = json.loads(required_calls([WEATHER, NOW], parallel=True).json_schema)
    jsonschema.validate(
        [{"name": "weather", "parameters": {"city": "Oslo"}}, {"name": "now", "parameters": {}}],
        schema,
    )
    for bad in (
        [],
        [{"name": "other", "parameters": {}}],
        [{"name": "weather", "parameters": {}}],
        [{"name": "now", "parameters": {}, "description": "x"}],
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    one = json.loads(required_calls([NOW], parallel=False).json_schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "now", "parameters": {}}] * 2, one)
