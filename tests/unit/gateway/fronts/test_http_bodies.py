"""Slow request bodies on the real HTTP front (loopback, raw sockets): a tenant's
bodies still arriving are capped (its max_concurrent caps them too), a body that
does not arrive in time is a 408 whose connection closes, and a body that comes
with its headers or right behind them takes no slot."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import cast

import pytest

from gateway.fronts.http.server import HttpFront
from gateway.request.pipeline import Pipeline
from ratelimit.config import LimitPolicy
from tests.unit.gateway.fronts.front_stubs import OneChunk

BODY = b'{"model":"m","prompt":"hi","max_tokens":1}'
LIMIT_S = 10.0  # far past any answer that is due at once; a hang is the bug


def head(length: int) -> bytes:
    return (
        "POST /v1/completions HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer k\r\n"
        f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
    ).encode()


async def status_of(reader: asyncio.StreamReader) -> int:
    line = await asyncio.wait_for(reader.readline(), LIMIT_S)
    return int(line.split()[1])


@pytest.fixture
async def front() -> AsyncIterator[tuple[HttpFront, OneChunk]]:
    pipeline = OneChunk(LimitPolicy(requests_per_minute=600, max_concurrent=1))
    http = HttpFront(cast(Pipeline, pipeline), "127.0.0.1", 0, body_timeout_s=0.5)
    await http.start()
    try:
        yield http, pipeline
    finally:
        await http.stop()


async def test_a_tenants_bodies_arriving_are_capped_and_time_out(
    front: tuple[HttpFront, OneChunk],
) -> None:
    http, pipeline = front
    stalled = await asyncio.open_connection("127.0.0.1", http.port)
    stalled[1].write(head(100_000) + b'{"model"')  # 8 bytes of 100000, then nothing
    await stalled[1].drain()
    for _ in range(1000):  # until its handler is reading the body
        if http.bodies.arriving("slow"):
            break
        await asyncio.sleep(0.01)
    others = []
    for _ in range(5):  # more of the same tenant's stalled bodies: refused at once
        reader, writer = await asyncio.open_connection("127.0.0.1", http.port)
        writer.write(head(100_000) + b'{"model"')
        await writer.drain()
        others.append((reader, writer))
    for reader, _ in others:
        assert await status_of(reader) == 429
    assert http.bodies.arriving("slow") == 1
    # the stalled body is cut off: 408, and the connection closes
    assert await status_of(stalled[0]) == 408
    assert await asyncio.wait_for(stalled[0].read(), LIMIT_S)  # the rest of the answer
    assert stalled[0].at_eof()
    # the tenant's body slot is back: a whole request goes through
    reader, writer = await asyncio.open_connection("127.0.0.1", http.port)
    writer.write(head(len(BODY)) + BODY)
    await writer.drain()
    assert await status_of(reader) == 200
    assert pipeline.calls == 1
    for _, w in [*others, stalled, (reader, writer)]:
        w.close()


async def test_a_body_that_comes_with_its_headers_takes_no_slot(
    front: tuple[HttpFront, OneChunk],
) -> None:
    # the tenant's one slot is held by a stalled body; ordinary requests, sent as
    # clients send them (whole, or the body in a write of its own right behind the
    # headers), still go through instead of getting 429
    http, pipeline = front
    stalled = await asyncio.open_connection("127.0.0.1", http.port)
    stalled[1].write(head(100_000) + b'{"model"')
    await stalled[1].drain()
    for _ in range(1000):
        if http.bodies.arriving("slow"):
            break
        await asyncio.sleep(0.01)
    assert http.bodies.arriving("slow") == 1
    whole = []
    for split in (False, False, True, True):
        reader, writer = await asyncio.open_connection("127.0.0.1", http.port)
        writer.write(head(len(BODY)))
        if split:  # the handler is reading before the body is sent
            await writer.drain()
            await asyncio.sleep(0.02)
        writer.write(BODY)
        await writer.drain()
        whole.append((reader, writer))
    for reader, _ in whole:
        assert await status_of(reader) == 200
    assert pipeline.calls == 4
    assert http.bodies.arriving("slow") == 1  # the stalled body still holds its slot
    for _, w in [*whole, stalled]:
        w.close()
