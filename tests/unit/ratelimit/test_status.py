"""RESOURCE_EXHAUSTED with retry-after-ms and QuotaFailure, through a real grpc.aio server."""

from __future__ import annotations

from typing import Any, cast

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2  # type: ignore[import-untyped]

from ratelimit.config import Dimension, LimitPolicy, Tenant
from ratelimit.errors import (
    ConflictError,
    LimiterUnavailableError,
    NotFoundError,
    PermissionDeniedError,
    StoreError,
    UnauthenticatedError,
)
from ratelimit.limiter.algorithm import Outcome
from ratelimit.limiter.decision import Decision
from ratelimit.limiter.rate_limiter import RateLimiter
from ratelimit.limiter.storage.memory import MemoryStore
from ratelimit.status import abort_denied, status_for


async def denied_decision() -> Decision:
    store = MemoryStore(lease_ttl_ms=1000, concurrency_retry_ms=1000, clock=lambda: 0.0)
    limiter = RateLimiter(store)
    tenant = Tenant("acme", LimitPolicy(tokens_per_minute=600, requests_per_minute=60))
    await limiter.reserve(tenant, 500)
    decision = await limiter.reserve(tenant, 200)
    assert not decision.allowed
    return decision


async def test_denial_carries_retry_after_and_quota_failure() -> None:
    decision = await denied_decision()
    assert decision.retry_after_ms == 10_000  # 100 tokens at 10/s

    async def handler(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        await abort_denied(context, decision)

    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(
                "t.T", {"Call": grpc.unary_unary_rpc_method_handler(handler)}
            )
        ]
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary("/t.T/Call", None, None)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call(b"")
    finally:
        await server.stop(0)
    err = info.value
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "tokens_per_minute" in (err.details() or "")
    assert "retry after 10000 ms" in (err.details() or "")
    trailers: dict[str, Any] = dict(cast(Any, err.trailing_metadata()))
    assert trailers["retry-after-ms"] == "10000"
    status = status_pb2.Status.FromString(trailers["grpc-status-details-bin"])
    quota = error_details_pb2.QuotaFailure()
    assert status.details[0].Unpack(quota)
    assert quota.violations[0].subject == "tenant:acme/tokens_per_minute"
    assert "needs 200, 100 available" in quota.violations[0].description
    retry = error_details_pb2.RetryInfo()
    assert status.details[1].Unpack(retry)
    assert retry.retry_delay.seconds == 10


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (UnauthenticatedError("x"), grpc.StatusCode.UNAUTHENTICATED),
        (PermissionDeniedError("x"), grpc.StatusCode.PERMISSION_DENIED),
        (NotFoundError("x"), grpc.StatusCode.NOT_FOUND),
        (ValueError("x"), grpc.StatusCode.INVALID_ARGUMENT),
        (StoreError("x"), grpc.StatusCode.UNAVAILABLE),
        (LimiterUnavailableError("x"), grpc.StatusCode.UNAVAILABLE),
        (ConflictError("x"), grpc.StatusCode.ABORTED),
        (KeyError("x"), grpc.StatusCode.INTERNAL),
    ],
)
def test_status_mapping(exc: Exception, code: grpc.StatusCode) -> None:
    assert status_for(exc)[0] == code


async def test_never_fitting_request_has_no_retry_after() -> None:
    store = MemoryStore(lease_ttl_ms=1000, concurrency_retry_ms=1000, clock=lambda: 0.0)
    decision = await RateLimiter(store).reserve(Tenant("t", LimitPolicy(tokens_per_minute=10)), 11)
    assert decision.retry_after_ms == -1
    assert "can never fit" in decision.message()
    assert "lower max_tokens" in decision.message()


def test_duration_text_is_openai_s_format() -> None:
    from ratelimit.status import duration_text

    assert [duration_text(s) for s in (0, 0.0201, 1.0, 1.25, 59.95, 360, 3725)] == [
        "0ms",
        "21ms",
        "1s",
        "1.3s",
        "60s",
        "6m0s",
        "1h2m5s",
    ]


def test_ratelimit_headers_say_limit_remaining_and_time_to_full() -> None:
    from dataclasses import replace

    from ratelimit.status import ratelimit_headers

    policy = LimitPolicy(requests_per_minute=60, request_burst=10, tokens_per_minute=6000)
    base = Decision.from_outcome(
        "t", policy, _outcome(requests_left=7.6, tokens_left=5400.0), "lease", 10, "redis"
    )
    h = ratelimit_headers(base, requests=True, tokens=True)
    assert h == {
        "x-ratelimit-limit-requests": "60",
        "x-ratelimit-remaining-requests": "7",  # whole requests
        "x-ratelimit-reset-requests": "2.4s",  # 2.4 requests at 1/s to a full burst of 10
        "x-ratelimit-limit-tokens": "6000",
        "x-ratelimit-remaining-tokens": "5400",
        "x-ratelimit-reset-tokens": "6s",  # 600 tokens at 100/s
    }
    assert set(ratelimit_headers(base, requests=True, tokens=False)) == {
        "x-ratelimit-limit-requests",
        "x-ratelimit-remaining-requests",
        "x-ratelimit-reset-requests",
    }
    unlimited = replace(base, policy=LimitPolicy(), requests_remaining=-1, tokens_remaining=-1)
    assert ratelimit_headers(unlimited, requests=True, tokens=True) == {}


def _outcome(requests_left: float, tokens_left: float) -> Outcome:
    return Outcome(True, Dimension.NONE, 0, requests_left, tokens_left, 1, 0.0)
