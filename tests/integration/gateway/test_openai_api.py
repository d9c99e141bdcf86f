"""The OpenAI-compatible HTTP front with the official ``openai`` client against the real stack.

Gateway subprocess, two real engines, real Redis and tokenizer: chat and text
completions, streamed and not, usage (``stream_options.include_usage``),
stop strings, seeded sampling, logprobs, models, request ids.
"""

from __future__ import annotations

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

pytestmark = pytest.mark.integration

QUESTION: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Name three colors."}]


def test_chat_completion_with_usage_and_request_id(client: openai.OpenAI) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model="",
        messages=QUESTION,
        max_tokens=8,
        temperature=0,
        extra_headers={"x-request-id": "my-req-42"},
        user="alice",
    )
    assert raw.headers["x-request-id"] == "my-req-42"
    resp = raw.parse()
    assert resp.id == "chatcmpl-my-req-42"
    assert resp.object == "chat.completion"
    assert resp.model.startswith("SmolLM2")
    (choice,) = resp.choices
    assert choice.message.role == "assistant"
    assert choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert resp.usage is not None
    assert resp.usage.completion_tokens <= 8
    assert resp.usage.prompt_tokens > 5  # the chat template was applied
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_text_completion(client: openai.OpenAI) -> None:
    resp = client.completions.create(
        model="", prompt="The capital of France is", max_tokens=6, temperature=0
    )
    assert resp.id.startswith("cmpl-")
    assert resp.object == "text_completion"
    (choice,) = resp.choices
    assert choice.text
    assert choice.finish_reason == "length"
    assert resp.usage is not None
    assert resp.usage.completion_tokens == 6


def test_streamed_chat_matches_non_streamed_and_reports_usage(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(
        model="", messages=QUESTION, max_tokens=12, temperature=0
    )
    stream = client.chat.completions.create(
        model="",
        messages=QUESTION,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finals[-1] == whole.choices[0].finish_reason
    assert all(f is None for f in finals[:-1])
    *body, last = chunks
    assert last.choices == []
    assert last.usage is not None
    assert all(c.usage is None for c in body)
    assert last.usage.completion_tokens == whole.usage.completion_tokens  # type: ignore[union-attr]
    assert last.usage.prompt_tokens == whole.usage.prompt_tokens  # type: ignore[union-attr]


def test_streamed_text_completion_without_usage(client: openai.OpenAI) -> None:
    chunks = list(
        client.completions.create(
            model="", prompt="1, 2, 3,", max_tokens=8, temperature=0, stream=True
        )
    )
    assert len(chunks) > 1
    assert all(c.usage is None for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert "".join(c.choices[0].text for c in chunks)


def test_stop_string_trims_the_output(client: openai.OpenAI) -> None:
    prompt = "Count: 1, 2, 3, 4, 5,"
    free = client.completions.create(model="", prompt=prompt, max_tokens=16, temperature=0)
    text = free.choices[0].text
    assert len(text) > 6, text
    stop = text[3:6]
    cut = text[: text.index(stop)]
    for stops in (stop, [stop, "never-appears"]):
        resp = client.completions.create(
            model="", prompt=prompt, max_tokens=16, temperature=0, stop=stops
        )
        assert resp.choices[0].text == cut
        assert resp.choices[0].finish_reason == "stop"


def test_seed_makes_sampling_reproducible(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        resp = client.chat.completions.create(
            model="",
            messages=[{"role": "user", "content": "Write a word."}],
            max_tokens=12,
            temperature=1.0,
            top_p=0.95,
            seed=seed,
            presence_penalty=0.5,
            frequency_penalty=0.5,
        )
        return resp.choices[0].message.content or ""

    first = sample(1234)
    assert sample(1234) == first
    others = {sample(s) for s in (1, 2, 3)}
    assert others != {first}  # sampling really samples


def test_logprobs(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(
        model="", messages=QUESTION, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3
    )
    lp = chat.choices[0].logprobs
    assert lp is not None
    assert lp.content is not None
    assert len(lp.content) == chat.usage.completion_tokens  # type: ignore[union-attr]
    for pos in lp.content:
        assert pos.logprob <= 0
        assert len(pos.top_logprobs) == 3
        assert pos.top_logprobs[0].logprob >= pos.top_logprobs[-1].logprob
        assert pos.logprob == pytest.approx(pos.top_logprobs[0].logprob)  # greedy
    text = client.completions.create(
        model="", prompt="Hello", max_tokens=3, temperature=0, logprobs=2
    )
    tlp = text.choices[0].logprobs
    assert tlp is not None
    assert tlp.tokens is not None
    assert tlp.top_logprobs is not None
    assert "".join(tlp.tokens) == text.choices[0].text
    assert tlp.text_offset == [sum(len(t) for t in tlp.tokens[:i]) for i in range(3)]
    assert all(len(alts) == 2 for alts in tlp.top_logprobs)


def test_models(client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert models, "no model listed"
    model = client.models.retrieve(models[0].id)
    assert model.id == models[0].id
    assert model.owned_by == "llm-serving-stack"
    resp = client.chat.completions.create(
        model=model.id, messages=QUESTION, max_completion_tokens=2
    )
    assert resp.model == model.id
    assert resp.usage is not None
    assert resp.usage.completion_tokens <= 2
