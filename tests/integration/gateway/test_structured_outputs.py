"""Structured outputs through the gateway's HTTP front with the official ``openai`` client,
over the session's real engines: ``chat.completions.parse`` with a Pydantic model (streamed
and not), ``json_object``, vLLM's ``guided_choice``/``guided_regex``, and the size cap as a
400 naming the field. Every constrained output parses."""

from __future__ import annotations

import json
import re

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam
from openai.types.shared_params import ResponseFormatJSONSchema
from pydantic import BaseModel, Field

pytestmark = pytest.mark.integration


class City(BaseModel):
    name: str = Field(max_length=12)
    country: str = Field(max_length=12)
    population_millions: int = Field(ge=0, le=100)


CITY_FORMAT: ResponseFormatJSONSchema = {
    "type": "json_schema",
    "json_schema": {"name": "City", "schema": City.model_json_schema()},
}
ASK: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Describe Paris as JSON."}]


def test_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    for temperature in (0.0, 1.0):
        done = client.chat.completions.parse(
            model="",
            messages=ASK,
            response_format=City,
            max_tokens=64,
            temperature=temperature,
            seed=7,
        )
        (choice,) = done.choices
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(choice.message.parsed, City)
        City.model_validate_json(choice.message.content or "")


def test_streamed_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    with client.chat.completions.stream(
        model="",
        messages=ASK,
        response_format=City,
        max_tokens=64,
        temperature=0.7,
        seed=3,
    ) as stream:
        deltas = [e.delta for e in stream if e.type == "content.delta"]
        done = stream.get_final_completion()
    assert len(deltas) > 1  # streamed as it came, not in one piece
    assert isinstance(done.choices[0].message.parsed, City)


def test_json_object_choice_and_regex(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model="",
        messages=ASK,
        response_format={"type": "json_object"},
        max_tokens=48,
        temperature=0,
    )
    content = resp.choices[0].message.content or ""
    if resp.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict)
    else:  # cut at max_tokens: still a prefix of an object
        assert content.lstrip().startswith("{")
    choice = client.chat.completions.create(
        model="",
        messages=[{"role": "user", "content": "Is the sky blue?"}],
        max_tokens=8,
        temperature=1.0,
        extra_body={"guided_choice": ["yes", "no"]},
    )
    assert choice.choices[0].message.content in ("yes", "no")
    date = client.completions.create(
        model="",
        prompt="The date today is",
        max_tokens=16,
        temperature=1.0,
        extra_body={"guided_regex": r"[0-9]{4}-[0-9]{2}-[0-9]{2}"},
    )
    assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", date.choices[0].text)


def test_oversized_and_conflicting_constraints_are_400s_naming_the_field(
    client: openai.OpenAI,
) -> None:
    big: dict[str, object] = {"type": "object", "description": "x" * 70_000}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="",
            messages=ASK,
            response_format={"type": "json_schema", "json_schema": {"name": "b", "schema": big}},
            max_tokens=4,
        )
    assert info.value.body["param"] == "response_format"  # type: ignore[index]
    assert "max_guided_chars" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="",
            messages=ASK,
            response_format={"type": "json_object"},
            max_tokens=4,
            extra_body={"guided_regex": "a+"},
        )
    assert info.value.body["param"] == "guided_regex"  # type: ignore[index]


def test_n_samples_each_fit_the_schema(client: openai.OpenAI) -> None:
    done = client.chat.completions.parse(
        model="", messages=ASK, response_format=City, n=2, max_tokens=64, temperature=0
    )
    assert [c.index for c in done.choices] == [0, 1]
    assert all(isinstance(c.message.parsed, City) for c in done.choices)
    assert done.usage is not None
    one = client.chat.completions.parse(
        model="", messages=ASK, response_format=City, max_tokens=64, temperature=0
    )
    assert one.usage is not None
    assert done.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt once
    assert done.usage.completion_tokens == 2 * one.usage.completion_tokens  # greedy: twins
    texts = ["", ""]
    for chunk in client.chat.completions.create(
        model="",
        messages=ASK,
        response_format=CITY_FORMAT,
        n=2,
        max_tokens=64,
        temperature=0,
        stream=True,
    ):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert [City.model_validate_json(t) for t in texts]
