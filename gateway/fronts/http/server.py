"""The HTTP front's server: aiohttp on the gateway's event loop, beside the gRPC server.

    HttpFront(pipeline, host, port).start()   bind, serve (returns the bound port)
    pipeline.drain()                          new requests 503, /health 503, streams finish
    HttpFront.stop()                          close the listener, then idle connections

One middleware wraps every request: it builds the ``CallContext`` (request
id from ``x-request-id`` or a new one, echoed on every response), turns
``ApiError`` and aiohttp's own errors (unknown path, wrong method) into
OpenAI's error shape, logs one access line and counts the response.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence

import structlog
from aiohttp import web
from prometheus_client import Counter

from common.log import get_logger
from gateway.domain import CallContext
from gateway.fronts.forwarded import TrustedProxies
from gateway.fronts.http.bodies import BodyGate
from gateway.fronts.http.errors import ApiError
from gateway.fronts.http.routes import (
    CALL_KEY,
    PROXIES_KEY,
    OpenAIRoutes,
    call_context,
    json_response,
)
from gateway.request.pipeline import Pipeline

log = get_logger(__name__)
MAX_BODY_BYTES = 8 * 1024 * 1024

RESPONSES = Counter(
    "gateway_http_responses_total",
    "Responses of the OpenAI-compatible HTTP front by route and HTTP status",
    ["route", "status"],
)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _route(request: web.Request) -> str:
    info = request.match_info.route.resource
    return info.canonical if info is not None else "unmatched"


@web.middleware
async def openai_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Request id, errors in OpenAI's shape, one access log line, response counts."""
    start = time.perf_counter()
    status = 500
    structlog.contextvars.clear_contextvars()  # keep-alive: nothing from the last request
    request[CALL_KEY] = CallContext(request_id=request.headers.get("x-request-id", ""))
    try:
        request[CALL_KEY] = call_context(request)
        response = await handler(request)
        status = response.status
        return response
    except ApiError as e:
        status = e.status
        return _error_response(e)
    except web.HTTPException as e:
        status = e.status
        kind = "server_error" if e.status >= 500 else "invalid_request_error"
        return _error_response(ApiError(e.status, e.reason, type=kind, code=_http_code(e)))
    except Exception:
        rid = request[CALL_KEY].request_id
        log.exception("http handler failed", request_id=rid)
        return _error_response(
            ApiError(
                500,
                f"internal gateway error; see the gateway log with request id {rid}",
                type="server_error",
                code="internal_error",
            )
        )
    finally:
        RESPONSES.labels(_route(request), str(status)).inc()
        emit = log.debug if request.path == "/health" else log.info  # probes every few s
        emit(
            "http request",
            method=request.method,
            path=request.path,
            status=status,
            request_id=request[CALL_KEY].request_id,
            duration_ms=round((time.perf_counter() - start) * 1000, 1),
        )


def _http_code(e: web.HTTPException) -> str:
    return {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(
        e.status, "http_error"
    )


def _error_response(e: ApiError) -> web.Response:
    return json_response(e.body(), status=e.status, headers=e.headers())


async def _request_id_header(request: web.Request, response: web.StreamResponse) -> None:
    """x-request-id and the tenant's x-ratelimit-* headers on every response (streamed,
    JSON or an error) of a request the pipeline got to."""
    call = request.get(CALL_KEY)
    if call is not None:
        response.headers["x-request-id"] = call.request_id
        response.headers.update(call.ratelimit)


class HttpFront:
    """The OpenAI-compatible HTTP server of one gateway process.

    Args:
        pipeline: The pipeline every front shares.
        host: Listen address.
        port: Listen port (0 = ephemeral).
        shutdown_timeout_s: How long ``stop`` waits for handlers still running
            (the pipeline's drain already gave streams their grace period).
        reuse_port: Share the port with sibling worker processes (SO_REUSEPORT).
        body_timeout_s: Longest a request body may take to arrive (0 = no limit).
        max_bodies_per_tenant: Request bodies one tenant may have arriving at once on
            this process (0 = no cap; a tenant's ``max_concurrent`` caps it too).
        trusted_proxies: Addresses and CIDR blocks whose ``x-forwarded-for`` names the
            client (Envoy's); from anyone else the peer is the client.
    """

    def __init__(
        self,
        pipeline: Pipeline,
        host: str,
        port: int,
        shutdown_timeout_s: float = 1.0,
        reuse_port: bool = False,
        body_timeout_s: float = 10.0,
        max_bodies_per_tenant: int = 4,
        trusted_proxies: Sequence[str] = (),
    ) -> None:
        self.host = host
        self.port = port
        self.reuse_port = reuse_port
        self.app = web.Application(middlewares=[openai_middleware], client_max_size=MAX_BODY_BYTES)
        self.app[PROXIES_KEY] = TrustedProxies(trusted_proxies)
        self.app.on_response_prepare.append(_request_id_header)
        self.bodies = BodyGate(body_timeout_s, max_bodies_per_tenant)
        OpenAIRoutes(pipeline, self.bodies).add_to(self.app)
        # handler_cancellation: a client that disconnects cancels its handler, which
        # closes the pipeline's generator and so cancels the engine call.
        # lingering_time=0: a connection whose body was not read (refused before it, or
        # too slow) closes after the answer instead of being read for 10 s more.
        self._runner = web.AppRunner(
            self.app,
            handler_cancellation=True,
            access_log=None,
            shutdown_timeout=shutdown_timeout_s,
            lingering_time=0,
        )

    async def start(self) -> int:
        """Bind and serve; returns the bound port."""
        await self._runner.setup()
        site = web.TCPSite(
            self._runner, self.host, self.port, reuse_address=True, reuse_port=self.reuse_port
        )
        await site.start()
        self.port = int(self._runner.addresses[0][1])
        log.info(
            "http serving",
            host=self.host,
            http_port=self.port,
            routes=["/v1/chat/completions", "/v1/completions", "/v1/models"],
        )
        return self.port

    async def stop(self) -> None:
        """Stop listening and close the connections (after the pipeline drained)."""
        await self._runner.cleanup()
        log.info("http stopped")
