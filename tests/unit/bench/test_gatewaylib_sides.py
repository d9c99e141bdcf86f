"""bench.gatewaylib.sides: what one timed request records."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest

from bench.gatewaylib import sides
from bench.gatewaylib.sides import PROMPT, completions_body, sample, timed_stream


def test_sample_times_the_first_token_and_text_and_the_mean_gaps() -> None:
    got = sample(1.0, [1.1, 1.2, 1.4], [1.2, 1.4])
    assert got == pytest.approx((0.1, 0.15, 0.2, 0.2))
    # no text events (the engine side): the tokens stand in for them
    assert sample(0.0, [0.5], []) == pytest.approx((0.5, 0.0, 0.0, 0.5))


def test_timed_stream_counts_each_token_and_only_text_bearing_chunks_as_events(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = iter([0.0, 0.010, 0.020, 0.030])
    monkeypatch.setattr("bench.gatewaylib.sides.time.perf_counter", lambda: next(clock))
    chunks = [
        SimpleNamespace(token_ids=[1, 2], text=""),  # held back: completes no character
        SimpleNamespace(token_ids=[3], text="Hi"),
        SimpleNamespace(token_ids=[4], text=" there"),
    ]

    async def stream() -> AsyncIterator[Any]:
        for c in chunks:
            yield c

    ttft, itl, gap, first_text = asyncio.run(timed_stream(stream()))
    assert ttft == pytest.approx(0.010)
    assert itl == pytest.approx((0.030 - 0.010) / 3)  # four tokens, three gaps
    assert gap == pytest.approx(0.010)  # two text events
    assert first_text == pytest.approx(0.020)


def test_the_http_sides_send_the_gateway_sides_request() -> None:
    body = completions_body(7)
    assert body["prompt"] == PROMPT
    assert (body["max_tokens"], body["stream"], body["ignore_eos"]) == (7, True, True)
    data = json.dumps({"choices": [{"text": "sea"}]}).encode()
    assert sides._text_of(data) == "sea"
    assert sides._text_of(b'{"choices": []}') == ""


def test_an_unknown_side_is_refused() -> None:
    async def open_it() -> None:
        async with sides.side_client("nope", {}, "k", [1], 1):
            pass

    with pytest.raises(ValueError, match="unknown side"):
        asyncio.run(open_it())
