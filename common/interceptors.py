"""Server interceptors shared by the services: gates that refuse a call before its
handler runs, and clean INVALID_ARGUMENT for request bytes that do not decode.

A gate (``GateInterceptor``) decides from the call's method and metadata alone;
a refused call gets a handler of the same RPC kind that ends it with the gate's
status. ``ServiceTokenInterceptor`` (engines, tokenizer: the internal-call
secret) and the gateway's reflection gate are gates.
"""

from __future__ import annotations

import hmac
import inspect
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import grpc

from common.service_auth import SERVICE_TOKEN_KEY

if TYPE_CHECKING:
    Handler = grpc.RpcMethodHandler[Any, Any]
else:  # the runtime class is not subscriptable
    Handler = grpc.RpcMethodHandler

_HANDLER_KINDS = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def refusing_handler(handler: Handler, code: grpc.StatusCode, message: str) -> Handler:
    """A handler of the same kind as ``handler`` that ends every call with ``code``."""

    async def refuse(request: Any, context: Any) -> None:  # any RPC kind may be a coroutine
        await context.abort(code, message)

    make = _HANDLER_KINDS[(handler.request_streaming, handler.response_streaming)]
    return make(
        refuse,
        request_deserializer=handler.request_deserializer,  # type: ignore[operator]
        response_serializer=handler.response_serializer,
    )


class GateInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc,type-arg]
    """Lets a call through, or ends it with the status ``refusal`` names."""

    async def refusal(self, details: grpc.HandlerCallDetails) -> tuple[grpc.StatusCode, str] | None:
        """(status, message) to refuse the call with; None lets it through."""
        raise NotImplementedError

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        refused = await self.refusal(handler_call_details)
        return handler if refused is None else refusing_handler(handler, *refused)


class ServiceTokenInterceptor(GateInterceptor):
    """Refuses calls without the service token (UNAUTHENTICATED), health excepted."""

    OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/",)

    def __init__(self, token: str) -> None:
        self._token = token.encode()

    async def refusal(self, details: grpc.HandlerCallDetails) -> tuple[grpc.StatusCode, str] | None:
        if details.method.startswith(self.OPEN_METHOD_PREFIXES):
            return None
        for key, value in details.invocation_metadata or ():
            if key == SERVICE_TOKEN_KEY:
                sent = value.encode() if isinstance(value, str) else bytes(value)
                if hmac.compare_digest(sent, self._token):
                    return None
                break
        return (
            grpc.StatusCode.UNAUTHENTICATED,
            f"this service answers only the gateway: the call carries no valid {SERVICE_TOKEN_KEY}",
        )


class _Undecodable:
    """Stands in for a request message that did not parse (e.g. bad UTF-8 in a string)."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _tolerant(deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserialize is None:
        return None

    def parse(raw: bytes) -> Any:
        try:
            return deserialize(raw)
        except Exception as e:  # DecodeError and friends: the client's bytes are bad
            return _Undecodable(str(e))

    return parse


def _invalid_message(bad: _Undecodable) -> str:
    return (
        f"the request message could not be decoded ({bad.reason}); string fields must "
        "be valid UTF-8"
    )


class DecodeErrorInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc,type-arg]
    """A request that does not parse is INVALID_ARGUMENT with the parser's reason.

    grpc itself answers such a request with UNKNOWN ("Exception deserializing
    request!"), which blames the server for the client's bytes (invalid UTF-8 in a
    string field, a truncated message). Unary-request handlers get a deserializer
    that never raises and a behaviour that refuses the undecodable request before
    it runs. For a streaming handler that is one more async-generator step per
    response (~80 ns, next to the ~100 us a gRPC message costs in Python).
    """

    def __init__(self) -> None:
        # method -> (its handler, the wrapped one): built once per method, not per call
        # (only methods the server has reach here, so this stays as small as the API)
        self._wrapped: dict[str, tuple[Handler, Handler]] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming:
            return handler
        method = handler_call_details.method
        cached = self._wrapped.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped = _refusing_undecodable(handler)
        self._wrapped[method] = (handler, wrapped)
        return wrapped


def _refusing_undecodable(handler: Handler) -> Handler:
    """``handler`` (unary request) with a deserializer that never raises, and a behaviour
    that ends an undecodable request with INVALID_ARGUMENT before it runs."""
    behavior: Any = handler.unary_stream if handler.response_streaming else handler.unary_unary
    wrapped: Any
    if inspect.isasyncgenfunction(behavior):  # yields its responses

        async def wrapped(request: Any, context: Any) -> Any:
            if isinstance(request, _Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _invalid_message(request))
            async for item in behavior(request, context):
                yield item

    elif inspect.iscoroutinefunction(behavior):  # returns a response or context.write()s

        async def wrapped(request: Any, context: Any) -> Any:
            if isinstance(request, _Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _invalid_message(request))
            return await behavior(request, context)

    else:
        return handler
    make = (
        grpc.unary_stream_rpc_method_handler
        if handler.response_streaming
        else grpc.unary_unary_rpc_method_handler
    )
    return make(
        wrapped,
        request_deserializer=_tolerant(handler.request_deserializer),
        response_serializer=handler.response_serializer,
    )
