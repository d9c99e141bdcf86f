"""Raw HTTP checks of the OpenAI front: SSE framing, no buffering, error bodies, request ids.

An aiohttp client reads the stream line by line with arrival times, so the
framing (``data: `` lines, blank-line separators, ``data: [DONE]``) and the
streaming itself (the first event arrives long before the last) are checked
on the wire, not through an SDK that might hide them.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest
from multidict import CIMultiDict

from tests.integration.gateway.conftest import HttpGateway

pytestmark = pytest.mark.integration


async def read_stream(
    url: str,
    key: str,
    body: dict[str, Any],
    on_first_event: Callable[[], None] = lambda: None,
) -> tuple[aiohttp.ClientResponse, list[tuple[float, str]]]:
    """(response, [(arrival time, line)]) of one streamed request; ``on_first_event``
    runs when the first ``data:`` line has arrived, before the next is read."""
    lines: list[tuple[float, str]] = []
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            url, json=body, headers={"Authorization": f"Bearer {key}", "x-request-id": "sse-1"}
        ) as resp,
    ):
        while True:
            raw = await resp.content.readline()
            if not raw:
                break
            if raw.startswith(b"data: ") and not any(t.startswith("data: ") for _, t in lines):
                on_first_event()
            lines.append((time.monotonic(), raw.decode()))
    return resp, lines


def test_sse_framing_and_no_buffering(http_gateway: HttpGateway) -> None:
    tid, key = http_gateway.gw.tenant()
    body = {
        "model": "",
        "messages": [{"role": "user", "content": "Count to twenty."}],
        "max_tokens": 48,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    leases_at_first_event: list[int] = []

    def first_event() -> None:  # the request's lease is held until its stream ends
        leases_at_first_event.append(http_gateway.gw.usage(tid).concurrent_in_use)

    resp, lines = asyncio.run(
        read_stream(http_gateway.base_url + "/chat/completions", key, body, first_event)
    )
    assert resp.status == 200
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    assert resp.headers["x-request-id"] == "sse-1"
    assert "Content-Length" not in resp.headers  # chunked: written as produced
    assert resp.headers["Cache-Control"] == "no-cache"
    texts = [line for _, line in lines]
    assert all(line.endswith("\n") for line in texts)
    events, blanks = texts[0::2], texts[1::2]
    assert all(b == "\n" for b in blanks), "every event ends with a blank line"
    assert len(events) == len(blanks)
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]\n"
    objs = [json.loads(e[len("data: ") :]) for e in events[:-1]]
    assert {o["id"] for o in objs} == {"chatcmpl-sse-1"}
    assert objs[-1]["choices"] == []
    assert objs[-1]["usage"]["completion_tokens"] == 48
    assert objs[-2]["choices"][0]["finish_reason"] == "length"
    # no buffering, by the order of events: the first event reached the client while the
    # request was still being served (its lease held), not after the whole completion
    assert leases_at_first_event == [1], "the stream was buffered until it ended"
    assert http_gateway.gw.usage(tid).concurrent_in_use == 0


def test_errors_are_json_in_openai_shape(http_gateway: HttpGateway) -> None:
    async def call(
        method: str, path: str, key: str, body: Any = None
    ) -> tuple[int, CIMultiDict[str], Any]:
        async with (
            aiohttp.ClientSession() as session,
            session.request(
                method,
                http_gateway.base_url + path,
                json=body,
                headers={"Authorization": f"Bearer {key}"},
            ) as resp,
        ):
            return resp.status, CIMultiDict(resp.headers), await resp.json()

    _, key = http_gateway.gw.tenant()
    status, headers, body = asyncio.run(call("POST", "/chat/completions", "nope", {}))
    assert status == 401
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert headers["x-request-id"]
    status, _, body = asyncio.run(call("POST", "/chat/completions", key, {"messages": "hi"}))
    assert (status, body["error"]["param"]) == (400, "messages")
    status, _, body = asyncio.run(call("POST", "/completions", key, {"prompt": [1, 2, 3]}))
    assert (status, body["error"]["param"]) == (400, "prompt")
    status, _, body = asyncio.run(call("GET", "/nothing-here", key))
    assert (status, body["error"]["code"]) == (404, "not_found")
    status, _, body = asyncio.run(call("GET", "/chat/completions", key))
    assert status == 405
    assert body["error"]["type"] == "invalid_request_error"
