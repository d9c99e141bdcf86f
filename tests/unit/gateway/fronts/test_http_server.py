"""The HTTP front's middleware: an unexpected error is a 500 in OpenAI's shape whose
request id the gateway's log line carries too."""

from __future__ import annotations

import structlog
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from gateway.fronts.http.server import openai_middleware


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
