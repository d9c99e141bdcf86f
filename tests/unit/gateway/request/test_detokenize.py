"""TextStream: engine token chunks -> client chunks (incremental text, stop strings,
usage, logprob token texts), across the attempts of one request."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.request.detokenize import TextStream
from llm.v1 import common_pb2, engine_pb2
from tokenizer_svc.tokenizer import TextTokenizer

TOKENS = [504, 3575, 282, 4649, 314, 7042]  # " The capital of France is Paris"
GOING = common_pb2.FINISH_REASON_UNSPECIFIED


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> TextTokenizer:
    return TextTokenizer(model_dir)


def chunk_of(
    ids: list[int],
    finish: common_pb2.FinishReason.ValueType = GOING,
    cached: int = 0,
) -> engine_pb2.EngineGenerateResponse:
    resp = engine_pb2.EngineGenerateResponse(token_ids=ids, finish_reason=finish)
    resp.usage.cached_prompt_tokens = cached
    return resp


def test_text_arrives_incrementally_and_the_last_chunk_carries_usage(
    tokenizer: TextTokenizer,
) -> None:
    text = TextStream("r1", tokenizer, [], 7)
    out = []
    for i, t in enumerate(TOKENS):
        last = i == len(TOKENS) - 1
        chunk = text.on_engine_chunk(chunk_of([t], common_pb2.LENGTH if last else GOING, 3))
        assert chunk is not None
        assert chunk.request_id == "r1"
        assert chunk.token_ids == [t]
        assert text.finished == last
        out.append(chunk)
    assert "".join(c.text for c in out) == tokenizer.decode(TOKENS)
    assert out[-1].finish_reason == common_pb2.LENGTH
    assert out[-1].usage == common_pb2.Usage(
        prompt_tokens=7, completion_tokens=6, cached_prompt_tokens=3
    )
    assert all(c.usage is None for c in out[:-1])
    assert all(c.model == "" for c in out)  # which model served is the dispatcher's to say


def test_a_stop_string_ends_the_stream_and_is_trimmed(tokenizer: TextTokenizer) -> None:
    text = TextStream("r1", tokenizer, [" France"], 7)
    sent = ""
    for t in TOKENS:
        chunk = text.on_engine_chunk(chunk_of([t]))
        if chunk is not None:
            sent += chunk.text
        if text.finished:
            break
    assert text.finish_reason == common_pb2.STOP
    assert sent == tokenizer.decode(TOKENS[:3])  # "The capital of", " France" cut
    assert text.usage().completion_tokens == len(text.token_ids)


def test_an_empty_engine_chunk_sends_nothing(tokenizer: TextTokenizer) -> None:
    text = TextStream("r1", tokenizer, [], 7)
    assert text.on_engine_chunk(chunk_of([])) is None
    assert not text.finished


def test_tokens_of_every_attempt_count_once_in_usage(tokenizer: TextTokenizer) -> None:
    """A failover resumes the same stream: what came before is neither lost nor repeated."""
    text = TextStream("r1", tokenizer, [], 7)
    first = [text.on_engine_chunk(chunk_of([t])) for t in TOKENS[:2]]
    rest = [text.on_engine_chunk(chunk_of([t])) for t in TOKENS[2:-1]]
    rest.append(text.on_engine_chunk(chunk_of(TOKENS[-1:], common_pb2.LENGTH)))
    assert text.token_ids == TOKENS
    assert "".join(c.text for c in first + rest if c) == tokenizer.decode(TOKENS)
    assert text.usage().completion_tokens == len(TOKENS)


def test_logprobs_carry_the_text_of_each_token(tokenizer: TextTokenizer) -> None:
    text = TextStream("r1", tokenizer, [], 7)
    resp = chunk_of([TOKENS[0]])
    pos = resp.logprobs.add()
    pos.chosen.token_id, pos.chosen.logprob = TOKENS[0], -0.1
    alt = pos.top.add()
    alt.token_id, alt.logprob = TOKENS[1], -2.0
    chunk = text.on_engine_chunk(resp)
    assert chunk is not None
    assert chunk.logprobs[0].chosen.text == tokenizer.decode([TOKENS[0]])
    assert chunk.logprobs[0].top[0].text == tokenizer.decode([TOKENS[1]])
