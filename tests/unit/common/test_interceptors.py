"""DecodeErrorInterceptor: undecodable requests are refused, and the wrapping is built
once per method rather than once per call."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from common.interceptors import DecodeErrorInterceptor, Handler


class Details:
    def __init__(self, method: str) -> None:
        self.method = method
        self.invocation_metadata: tuple[()] = ()


class Aborted(Exception):
    pass


class Context:
    async def abort(self, code: grpc.StatusCode, message: str) -> None:
        raise Aborted(code, message)


async def stream(request: Any, context: Any) -> AsyncIterator[str]:
    yield f"got {request}"


def strict(raw: bytes) -> str:
    return raw.decode("utf-8")


def make_handler() -> Handler:
    return grpc.unary_stream_rpc_method_handler(stream, request_deserializer=strict)


async def test_the_wrapped_handler_is_built_once_per_method_and_refuses_bad_bytes() -> None:
    intercept: Any = DecodeErrorInterceptor().intercept_service  # test doubles, untyped
    served = {"/s/A": make_handler(), "/s/B": make_handler()}

    async def continuation(details: Any) -> Any:
        return served.get(details.method)

    first: Any = await intercept(continuation, Details("/s/A"))
    again = await intercept(continuation, Details("/s/A"))
    other = await intercept(continuation, Details("/s/B"))
    assert first is again  # no per-call handler, closure or deserializer
    assert other is not first
    assert await intercept(continuation, Details("/nope")) is None

    ok = first.request_deserializer(b"hi")
    assert [x async for x in first.unary_stream(ok, Context())] == ["got hi"]
    bad = first.request_deserializer(b"\xff")
    with pytest.raises(Aborted) as err:
        [x async for x in first.unary_stream(bad, Context())]
    assert err.value.args[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert "UTF-8" in err.value.args[1]

    served["/s/A"] = replaced = make_handler()  # an inner interceptor's own handler
    swapped = await intercept(continuation, Details("/s/A"))
    assert swapped is not first
    assert swapped.request_deserializer is not replaced.request_deserializer
