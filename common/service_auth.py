"""The shared secret of internal calls: engines and tokenizers answer only the gateway.

A service started with ``service_token_file`` (engine, tokenizer) refuses every
RPC that does not carry that token in ``x-service-token`` metadata with
UNAUTHENTICATED, before its handler runs; ``grpc.health.v1`` stays open for
probes. The gateway reads the same file and sends the token on every call to
an engine or tokenizer. ``make run`` generates the file; deployments mount it
from a Secret. An empty ``service_token_file`` leaves a service open (tests and
single-host development), and the service logs that it is.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from common.config import ROOT

if TYPE_CHECKING:
    Handler = grpc.RpcMethodHandler[Any, Any]
else:
    Handler = grpc.RpcMethodHandler

SERVICE_TOKEN_KEY = "x-service-token"
MIN_TOKEN_CHARS = 32
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/",)


def read_service_token(path: str) -> str:
    """The token in ``path`` ("" for an empty path: no service auth).

    Raises:
        ValueError: the file is missing, or holds fewer than 32 characters.
    """
    if not path:
        return ""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"service_token_file {path!r} does not exist")
    token = file.read_text().strip()
    if len(token) < MIN_TOKEN_CHARS:
        raise ValueError(f"service_token_file {path!r} must hold a token of at least "
                         f"{MIN_TOKEN_CHARS} characters (e.g. `openssl rand -hex 32`)")
    return token


def default_token_file() -> str:
    """``make run``'s token (``$LLM_RUN_DIR`` or ``.run/``, ``service.token``) when it
    exists, else "": what command-line clients use unless told otherwise."""
    path = Path(os.environ.get("LLM_RUN_DIR") or ROOT / ".run") / "service.token"
    return str(path) if path.is_file() else ""


def token_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """Metadata to add to a call to an internal service (empty without a token)."""
    return ((SERVICE_TOKEN_KEY, token),) if token else ()


class ServiceTokenInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc,type-arg]
    """Refuses calls without the service token (UNAUTHENTICATED), health excepted."""

    def __init__(self, token: str) -> None:
        self._token = token.encode()

    def _allowed(self, details: grpc.HandlerCallDetails) -> bool:
        if details.method.startswith(OPEN_METHOD_PREFIXES):
            return True
        for key, value in details.invocation_metadata or ():
            if key == SERVICE_TOKEN_KEY:
                sent = value.encode() if isinstance(value, str) else bytes(value)
                return hmac.compare_digest(sent, self._token)
        return False

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler:
        handler = await continuation(handler_call_details)
        if handler is None or self._allowed(handler_call_details):
            return handler
        return refusing_handler(handler, grpc.StatusCode.UNAUTHENTICATED,
                                "this service answers only the gateway: the call carries no "
                                f"valid {SERVICE_TOKEN_KEY}")


def refusing_handler(handler: Handler, code: grpc.StatusCode, message: str) -> Handler:
    """A handler of the same kind as ``handler`` that ends every call with ``code``."""

    async def refuse(request: Any, context: Any) -> None:  # any RPC kind may be a coroutine
        await context.abort(code, message)

    make = _HANDLER_KINDS[(handler.request_streaming, handler.response_streaming)]
    return make(refuse, request_deserializer=handler.request_deserializer,  # type: ignore[operator]
                response_serializer=handler.response_serializer)


_HANDLER_KINDS = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}
