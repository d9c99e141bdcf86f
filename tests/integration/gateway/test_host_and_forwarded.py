"""Repeated Host headers are a 400 at the edge (a real Envoy, which would otherwise
join them into one authority and pass the request on) and on the gateway's own HTTP
port; x-forwarded-for counts only from a configured proxy (the real HTTP front on
loopback, raw sockets)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import cast

import pytest

from gateway.fronts.http.server import HttpFront
from gateway.request.pipeline import Pipeline
from tests.integration.gateway.edge_helpers import envoy_in_front
from tests.unit.gateway.fronts.front_stubs import OneChunk

pytestmark = pytest.mark.integration
BODY = b'{"model":"m","prompt":"hi","max_tokens":1}'


async def send(port: int, *headers: str) -> tuple[int, dict[str, object]]:
    """One POST with these header lines: (status, JSON body)."""
    lines = "".join(f"{h}\r\n" for h in headers)
    raw = (
        f"POST /v1/completions HTTP/1.1\r\n{lines}Authorization: Bearer k\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(BODY)}\r\n"
        "Connection: close\r\n\r\n"
    ).encode() + BODY
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(raw)
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body) if body.startswith(b"{") else {}


@pytest.fixture
async def front() -> AsyncIterator[tuple[HttpFront, OneChunk]]:
    pipeline = OneChunk()
    http = HttpFront(cast(Pipeline, pipeline), "127.0.0.1", 0)
    await http.start()
    try:
        yield http, pipeline
    finally:
        await http.stop()


async def test_two_host_headers_are_400_on_the_gateways_port(
    front: tuple[HttpFront, OneChunk],
) -> None:
    http, pipeline = front
    status, _ = await send(http.port, "Host: a.example", "Host: b.example")
    assert status == 400  # aiohttp's parser refuses it before any handler
    assert pipeline.calls == 0
    assert pipeline.auth.calls == []  # refused before the key is looked at
    assert (await send(http.port, "Host: a.example"))[0] == 200


async def test_two_host_headers_are_400_at_envoy(
    front: tuple[HttpFront, OneChunk], tmp_path: Path
) -> None:
    http, pipeline = front
    envoy = await envoy_in_front(http.port, tmp_path)
    try:
        port = envoy.listener_port()
        status, body = await send(port, "Host: a.example", "Host: b.example")
        assert status == 400
        assert cast(dict[str, str], body["error"])["code"] == "duplicate_host"
        assert pipeline.auth.calls == []  # never reached the gateway
        assert (await send(port, "Host: a.example"))[0] == 200
        assert len(pipeline.auth.calls) == 1
    finally:
        await asyncio.to_thread(envoy.stop)


@pytest.mark.parametrize(
    ("trusted", "source"),
    [
        ((), "127.0.0.1"),  # the default: no proxy is trusted, the peer is the client
        (("10.0.0.0/8",), "127.0.0.1"),  # a proxy elsewhere: this peer is not one
        (("127.0.0.1",), "198.51.100.9"),  # from the proxy: its last hop
        (("127.0.0.0/8", "::1"), "198.51.100.9"),
    ],
)
async def test_x_forwarded_for_counts_only_from_a_trusted_proxy(
    trusted: tuple[str, ...], source: str
) -> None:
    pipeline = OneChunk()
    http = HttpFront(cast(Pipeline, pipeline), "127.0.0.1", 0, trusted_proxies=trusted)
    await http.start()
    try:
        status, _ = await send(http.port, "Host: gw", "X-Forwarded-For: 203.0.113.1, 198.51.100.9")
    finally:
        await http.stop()
    assert status == 200
    assert [c.source for c in pipeline.auth.calls] == [source]
