"""The HTTP front over a recording pipeline: an unexpected error is a 500 whose request
id the log line carries too; the session key of sticky version routing."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import cast

import pytest
import structlog
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from gateway.domain import MAX_SESSION_KEY_CHARS, CallContext, Chunk, session_key
from gateway.fronts.http.routes import OpenAIRoutes
from gateway.fronts.http.server import openai_middleware
from gateway.request.pipeline import Pipeline
from llm.v1 import common_pb2, gateway_pb2
from ratelimit.config import Tenant


async def boom(request: web.Request) -> web.StreamResponse:
    raise RuntimeError("a bug")


async def test_a_500_names_the_request_id_its_log_line_carries() -> None:
    app = web.Application(middlewares=[openai_middleware])
    app.router.add_post("/v1/completions", boom)
    async with TestClient(TestServer(app)) as client:
        with structlog.testing.capture_logs() as logs:
            resp = await client.post("/v1/completions", headers={"x-request-id": "req-42"})
            body = await resp.json()
    assert resp.status == 500
    assert body["error"]["code"] == "internal_error"
    assert "req-42" in body["error"]["message"]
    (failure,) = [e for e in logs if e["event"] == "http handler failed"]
    assert failure["request_id"] == "req-42"
    assert failure["log_level"] == "error"


class Auth:
    async def tenant(self, call: CallContext) -> Tenant:
        return Tenant("t")


class RecordingPipeline:
    """Stands for the pipeline: takes the call, answers one finished chunk."""

    def __init__(self) -> None:
        self.auth = Auth()
        self.calls: list[CallContext] = []

    async def generate(
        self, request: gateway_pb2.GenerateRequest, call: CallContext
    ) -> AsyncIterator[Chunk]:
        self.calls.append(call)
        yield Chunk(
            call.request_id,
            text="hi",
            token_ids=[1],
            finish_reason=common_pb2.STOP,
            usage=common_pb2.Usage(prompt_tokens=3, completion_tokens=1),
            model="m",
        )


@pytest.mark.parametrize(
    ("headers", "user", "key"),
    [
        ({"x-session-id": "conv-1"}, "alice", "conv-1"),  # the header wins
        ({}, "alice", "alice"),  # else OpenAI's user field
        ({}, "", ""),
        ({"x-session-id": "s" * 300}, "", "s" * MAX_SESSION_KEY_CHARS),
    ],
)
async def test_the_http_front_carries_the_session_key_for_sticky_versions(
    headers: dict[str, str], user: str, key: str
) -> None:
    pipeline = RecordingPipeline()
    app = web.Application(middlewares=[openai_middleware])
    OpenAIRoutes(cast(Pipeline, pipeline)).add_to(app)
    body: dict[str, object] = {"messages": [{"role": "user", "content": "Hi"}]}
    if user:
        body["user"] = user
    async with TestClient(TestServer(app)) as client:
        resp = await client.post(
            "/v1/chat/completions", json=body, headers={"Authorization": "Bearer k", **headers}
        )
        assert resp.status == 200, await resp.text()
    (call,) = pipeline.calls
    assert call.session_key == key


def test_session_key_prefers_the_header_and_is_bounded() -> None:
    assert session_key("a", "b") == "a"
    assert session_key("", "b") == "b"
    assert session_key("x" * 1000) == "x" * MAX_SESSION_KEY_CHARS
