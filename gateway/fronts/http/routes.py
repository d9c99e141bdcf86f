"""The OpenAI-compatible endpoints over the shared pipeline.

    POST /v1/chat/completions   chat messages -> completion (JSON or SSE)
    POST /v1/completions        prompt -> completion (JSON or SSE)
    GET  /v1/models             models the caller's tenant may use
    GET  /v1/models/{model}     one of them (404 otherwise)
    GET  /health                200 while serving, 503 while draining (Envoy's health check)

Handlers only convert: body -> GenerateRequest, ``Chunk`` -> OpenAI JSON,
``GatewayError`` -> OpenAI error. Auth, limits, routing, retries, failover,
cancellation and metrics happen in ``Pipeline`` exactly as for gRPC. A
client that goes away cancels the handler (aiohttp ``handler_cancellation``),
which closes the pipeline's generator and so cancels the engine call.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
from aiohttp import web

from common.log import get_logger
from gateway.domain import (
    SESSION_KEY_HEADER,
    CallContext,
    Chunk,
    GatewayError,
    session_key,
)
from gateway.fleet.replica_pool import ModelEntry
from gateway.fronts.forwarded import TrustedProxies
from gateway.fronts.http.bodies import BodyGate
from gateway.fronts.http.errors import ApiError
from gateway.fronts.http.fields import check_body
from gateway.fronts.http.requests import ParsedRequest, parse
from gateway.fronts.http.responses import Formatter
from gateway.fronts.http.sse import EventStream
from gateway.request.pipeline import Pipeline
from llm.v1 import common_pb2

log = get_logger(__name__)
CALL_KEY = web.RequestKey("call", CallContext)
PROXIES_KEY = web.AppKey("trusted_proxies", TrustedProxies)  # none set: trust no one
TIMEOUT_HEADER = "x-request-timeout"  # seconds; the HTTP twin of grpc-timeout
OWNER = "llm-serving-stack"
_NO_PROXIES = TrustedProxies()
LOGGED_FIELD_CHARS = 64  # client-supplied strings are truncated to this in logs


def call_context(request: web.Request) -> CallContext:
    """The pipeline's call context from the request headers (``x-forwarded-for`` only
    from a proxy the app trusts, ``PROXIES_KEY``).

    Raises:
        ApiError: 400 when ``x-request-timeout`` is not a positive number of seconds.
    """
    timeout: float | None = None
    raw = request.headers.get(TIMEOUT_HEADER)
    if raw is not None:
        try:
            timeout = float(raw)
        except ValueError:
            timeout = -1.0
        if not 0 < timeout < float("inf"):
            raise ApiError.invalid(
                None, f"header {TIMEOUT_HEADER} must be a positive number of seconds, got {raw!r}"
            )
    return CallContext(
        authorization=request.headers.get("Authorization", ""),
        request_id=request.headers.get("x-request-id", ""),
        traceparent=request.headers.get("traceparent", ""),
        timeout_s=timeout,
        session_key=session_key(request.headers.get(SESSION_KEY_HEADER, "")),
        source=request.app.get(PROXIES_KEY, _NO_PROXIES).source(
            request.headers.get("x-forwarded-for", ""), request.remote or ""
        ),
    )


def json_response(
    obj: Any, status: int = 200, headers: dict[str, str] | None = None
) -> web.Response:
    """A JSON response (compact, UTF-8)."""
    return web.json_response(
        obj,
        status=status,
        headers=headers,
        dumps=lambda o: json.dumps(o, ensure_ascii=False, separators=(",", ":")),
    )


class OpenAIRoutes:
    """Request handlers of the HTTP front.

    Args:
        pipeline: The pipeline every front shares.
        bodies: Request bodies arriving per tenant, and how long one may take.
    """

    def __init__(self, pipeline: Pipeline, bodies: BodyGate | None = None) -> None:
        self.pipeline = pipeline
        self.bodies = bodies or BodyGate()
        self.started = int(time.time())

    def add_to(self, app: web.Application) -> None:
        """Mount every route on ``app``."""
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model:.+}", self.model)
        app.router.add_get("/health", self.health)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/chat/completions."""
        return await self._generate(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/completions."""
        return await self._generate(request, chat=False)

    async def models(self, request: web.Request) -> web.Response:
        """GET /v1/models."""
        entries = await self._models(request)
        return json_response({"object": "list", "data": [self._card(e) for e in entries]})

    async def model(self, request: web.Request) -> web.Response:
        """GET /v1/models/{model}."""
        name = request.match_info["model"]
        for e in await self._models(request):
            if e.model == name:
                return json_response(self._card(e))
        raise ApiError(
            404,
            f"unknown model {name!r}; GET /v1/models lists the available ones",
            param="model",
            code="model_not_found",
        )

    async def health(self, request: web.Request) -> web.Response:
        """GET /health: 503 once the gateway drains, so load balancers move away first."""
        if self.pipeline.draining:
            return json_response({"status": "draining"}, status=503)
        return json_response({"status": "ok"})

    async def _models(self, request: web.Request) -> list[ModelEntry]:
        try:
            return await self.pipeline.list_models(request[CALL_KEY])
        except GatewayError as e:
            raise ApiError.from_gateway(e) from None

    def _card(self, e: ModelEntry) -> dict[str, Any]:
        return {
            "id": e.model,
            "object": "model",
            "created": self.started,
            "owned_by": OWNER,
            "max_model_len": e.max_context_length,
            "versions": sorted(e.versions),
            **({"route_targets": list(e.targets)} if e.targets else {}),
        }

    async def _parse(self, request: web.Request, chat: bool) -> ParsedRequest:
        """The converted body; a bad body is reported after the key is checked (401 first)."""
        try:
            try:
                body = await request.json()
            except UnicodeDecodeError:
                raise ApiError.invalid(None, "the request body is not valid UTF-8") from None
            except LookupError:  # an unknown charset, or a bytes-to-bytes codec (rot13)
                raise ApiError.invalid(
                    None,
                    f"cannot decode a body in charset {request.charset!r}: send JSON in UTF-8",
                ) from None
            except ValueError:
                raise ApiError.invalid(None, "the request body is not valid JSON") from None
            except RecursionError:  # the decoder's own nesting limit (~1000 levels)
                raise ApiError.invalid(None, "the request body nests too deeply") from None
            check_body(body)
            return parse(body, chat=chat)
        except ApiError:
            try:
                await self.pipeline.auth.tenant(request[CALL_KEY])
            except GatewayError as e:
                raise ApiError.from_gateway(e) from None
            raise

    async def _generate(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        call = request[CALL_KEY]
        try:  # the key first: an unauthenticated caller gets no body read or parsed
            t0 = time.perf_counter()
            call.tenant = await self.pipeline.auth.tenant(call)
            call.auth_at = (t0, time.perf_counter())  # the auth span, when tracing is on
        except GatewayError as e:
            raise ApiError.from_gateway(e, chat=chat) from None
        await self.bodies.read(request, call.tenant)
        parsed = await self._parse(request, chat)
        call.session_key = session_key(call.session_key, parsed.user)
        if parsed.user:  # client text in logs: cut short
            log.info(
                "openai request",
                user=parsed.user[:LOGGED_FIELD_CHARS],
                model=parsed.request.model[:LOGGED_FIELD_CHARS],
            )
        fmt = Formatter(parsed, call.request_id, parsed.request.model)
        chunks = self.pipeline.generate(parsed.request, call)
        async with contextlib.aclosing(chunks):
            if parsed.stream:
                return await self._stream(request, chunks, fmt)
            try:
                async for chunk in chunks:
                    fmt.add(chunk)
            except GatewayError as e:
                raise ApiError.from_gateway(e, chat=chat) from None
        if fmt.finish_reason == common_pb2.CANCELLED:
            raise ApiError(
                504,
                "the request deadline passed before the completion finished",
                type="timeout_error",
                code="deadline_exceeded",
            )
        return json_response(fmt.final())

    async def _stream(
        self, request: web.Request, chunks: AsyncIterator[Chunk], fmt: Formatter
    ) -> web.StreamResponse:
        events = EventStream(request, {"x-request-id": request[CALL_KEY].request_id})
        try:
            async for chunk in chunks:
                if fmt.chat and not events.started:
                    for obj in fmt.role_chunks():
                        await events.send(obj)
                if chunk.finish_reason == common_pb2.CANCELLED:
                    raise GatewayError(
                        grpc.StatusCode.DEADLINE_EXCEEDED,
                        "the request deadline passed before the completion finished",
                    )
                for obj in fmt.stream_chunk(chunk):
                    await events.send(obj)
        except GatewayError as e:
            if not events.started:
                raise ApiError.from_gateway(e, chat=fmt.chat) from None
            await events.send(ApiError.from_gateway(e, chat=fmt.chat).body())
            return await events.close()
        if fmt.parsed.include_usage:
            await events.send(fmt.usage_chunk())
        return await events.close()
