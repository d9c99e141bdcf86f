"""Overload answers of the HTTP front are 429 with Retry-After, which Envoy does not retry.

The gateway's real HTTP front (aiohttp on a loopback port) with the real
authenticator on a real Redis, behind a real Envoy. The pipeline stands for the
engine fleet: every call finds every engine replica at capacity, and counts
itself, so a retry by Envoy shows as a second call.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import cast

import aiohttp
import grpc
import pytest
from redis.asyncio import Redis

from common.redis_server import RedisServer
from gateway.domain import CallContext, Chunk, GatewayError
from gateway.fronts.http.server import HttpFront
from gateway.request.authenticate import Authenticator, FailedAuthThrottle
from gateway.request.pipeline import Pipeline
from llm.v1 import gateway_pb2
from ratelimit.config import LimitPolicy, Tenant
from ratelimit.tenancy.records import KeyRole
from ratelimit.tenancy.registry import Registry
from tests.integration.gateway.edge_helpers import envoy_in_front

pytestmark = pytest.mark.integration
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
NAT = "198.51.100.77"  # the address Envoy appends for every client behind one NAT


class FullEngines:
    """The pipeline's face to the front: a real authenticator; every generate finds
    every engine replica at capacity (the dispatcher's answer)."""

    def __init__(self, auth: Authenticator) -> None:
        self.auth = auth
        self.draining = False
        self.calls = 0

    async def generate(
        self, request: gateway_pb2.GenerateRequest, call: CallContext
    ) -> AsyncIterator[Chunk]:
        self.calls += 1
        raise GatewayError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "every engine replica tried is at capacity; retry after 700 ms",
            retry_after_ms=700,
        )
        yield  # pragma: no cover - a generator


async def _front(redis_url: str) -> tuple[HttpFront, FullEngines, Registry, Redis]:
    client = Redis.from_url(redis_url, decode_responses=True)
    registry = Registry(client, prefix="overload:")  # type: ignore[arg-type]
    await registry.upsert_tenant(Tenant("acme", LimitPolicy(requests_per_minute=600)))
    pipeline = FullEngines(Authenticator(registry, FailedAuthThrottle(per_minute=1, burst=3)))
    front = HttpFront(cast(Pipeline, pipeline), "127.0.0.1", 0)
    await front.start()
    return front, pipeline, registry, client


async def _post(
    session: aiohttp.ClientSession, url: str, key: str, source: str = ""
) -> tuple[int, dict[str, str], dict[str, dict[str, str]]]:
    headers = {"Authorization": f"Bearer {key}"}
    if source:
        headers["x-forwarded-for"] = source
    async with session.post(url + "/v1/chat/completions", json=BODY, headers=headers) as resp:
        return resp.status, dict(resp.headers), await resp.json()


async def test_full_engines_and_the_auth_throttle_are_429_and_envoy_tries_once(
    gw_redis: RedisServer, tmp_path: Path
) -> None:
    front, pipeline, registry, client = await _front(gw_redis.url)
    envoy = await envoy_in_front(front.port, tmp_path)
    try:
        valid, _ = await registry.create_key("acme", "app", KeyRole.TENANT)
        url = f"http://{envoy.listener_address()}"
        async with aiohttp.ClientSession() as session:
            status, headers, body = await _post(session, url, valid)
            assert status == 429
            assert body["error"]["code"] == "engine_overloaded"
            assert headers["Retry-After"] == "1"
            assert headers["retry-after-ms"] == "700"
            assert pipeline.calls == 1  # Envoy did not retry it on another try

            # the failed-auth throttle: an address past its burst of failures
            codes = [
                (await _post(session, url, f"sk-llm-made-up-{i:02d}-" + "x" * 30, NAT))[0]
                for i in range(5)
            ]
            assert codes[:3] == [401, 401, 401]
            assert codes[3:] == [429, 429]
            status, headers, body = await _post(session, url, "sk-llm-made-up-00-" + "x" * 30, NAT)
            assert status == 429
            assert body["error"]["code"] == "auth_throttled"
            assert int(headers["Retry-After"]) >= 1
            assert "retry-after-ms" in headers
            # a valid key behind the same address, never seen by this gateway, still works
            neighbour, _ = await registry.create_key("acme", "neighbour", KeyRole.TENANT)
            calls = pipeline.calls
            status, _, body = await _post(session, url, neighbour, NAT)
            assert (status, body["error"]["code"]) == (429, "engine_overloaded")
            assert pipeline.calls == calls + 1  # authenticated, then the engines were full
    finally:
        await asyncio.to_thread(envoy.stop)
        await front.stop()
        await client.aclose()
