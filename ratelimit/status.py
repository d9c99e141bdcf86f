"""gRPC statuses for limiter and registry outcomes (used by the admin service and the gateway).

A denial becomes RESOURCE_EXHAUSTED with, in the trailing metadata:

    retry-after-ms            "1234"  (absent when the request can never fit)
    grpc-status-details-bin   google.rpc.Status{QuotaFailure, RetryInfo}

which is what ``grpcio-status``' ``rpc_status.to_status`` would send, built
here by hand so no extra dependency is needed.
"""

from __future__ import annotations

import math
from typing import NoReturn

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2  # type: ignore[import-untyped]

from ratelimit.errors import (
    ConflictError,
    LimiterUnavailableError,
    NotFoundError,
    PermissionDeniedError,
    StoreError,
    UnauthenticatedError,
)
from ratelimit.limiter.decision import Decision

RETRY_AFTER_KEY = "retry-after-ms"
DETAILS_KEY = "grpc-status-details-bin"
Metadata = tuple[tuple[str, str | bytes], ...]

_CODES: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (UnauthenticatedError, grpc.StatusCode.UNAUTHENTICATED),
    (PermissionDeniedError, grpc.StatusCode.PERMISSION_DENIED),
    (NotFoundError, grpc.StatusCode.NOT_FOUND),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
    (StoreError, grpc.StatusCode.UNAVAILABLE),
    (LimiterUnavailableError, grpc.StatusCode.UNAVAILABLE),
    (ConflictError, grpc.StatusCode.ABORTED),
)


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and message for an exception (INTERNAL when unexpected)."""
    for cls, code in _CODES:
        if isinstance(exc, cls):
            return code, str(exc)
    return grpc.StatusCode.INTERNAL, f"internal error ({type(exc).__name__}); see server logs"


def duration_text(seconds: float) -> str:
    """A wait as OpenAI's rate-limit headers write it: ``20ms``, ``1.5s``, ``6m0s``, ``1h2m5s``."""
    if seconds < 1:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    if seconds < 60:
        return f"{math.ceil(round(seconds * 10, 6)) / 10:g}s"
    total = math.ceil(seconds)
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    return (f"{hours}h" if hours else "") + f"{minutes}m{secs}s"


def ratelimit_headers(decision: Decision, *, requests: bool, tokens: bool) -> dict[str, str]:
    """OpenAI's rate-limit headers for what ``decision`` saw of the tenant's buckets:
    ``x-ratelimit-{limit,remaining,reset}-{requests,tokens}`` (limit per minute, whole
    units left, time until the bucket is full again). A dimension without a limit, or
    one this decision did not check, gets none."""
    p, out = decision.policy, {}
    dims = (
        (
            "requests",
            requests,
            p.requests_per_minute,
            p.request_capacity,
            decision.requests_remaining,
        ),
        ("tokens", tokens, p.tokens_per_minute, p.token_capacity, decision.tokens_remaining),
    )
    for name, wanted, per_minute, capacity, left in dims:
        if not wanted or per_minute <= 0 or left < 0:
            continue
        level = min(float(capacity), left)
        out[f"x-ratelimit-limit-{name}"] = str(per_minute)
        out[f"x-ratelimit-remaining-{name}"] = str(max(0, math.floor(level)))
        out[f"x-ratelimit-reset-{name}"] = duration_text((capacity - level) * 60.0 / per_minute)
    return out


def denial_metadata(decision: Decision) -> Metadata:
    """Trailing metadata of a RESOURCE_EXHAUSTED denial: retry-after-ms and rich details."""
    violations = [(f"tenant:{decision.tenant_id}/{s}", t) for s, t in decision.violations()]
    return quota_metadata(violations, decision.retry_after_ms, decision.message())


def quota_metadata(
    violations: list[tuple[str, str]], retry_after_ms: int, message: str
) -> Metadata:
    """``retry-after-ms`` (when >= 0) and a ``grpc-status-details-bin`` holding a
    ``QuotaFailure`` of (subject, description) violations and a ``RetryInfo``."""
    quota = error_details_pb2.QuotaFailure(
        violations=[
            error_details_pb2.QuotaFailure.Violation(subject=subject, description=text)
            for subject, text in violations
        ]
    )
    details = [_pack(quota)]
    md: list[tuple[str, str | bytes]] = []
    if retry_after_ms >= 0:
        ms = retry_after_ms
        retry = error_details_pb2.RetryInfo(
            retry_delay=duration_pb2.Duration(seconds=ms // 1000, nanos=(ms % 1000) * 1_000_000)
        )
        details.append(_pack(retry))
        md.append((RETRY_AFTER_KEY, str(ms)))
    status = status_pb2.Status(
        code=grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], message=message, details=details
    )
    md.append((DETAILS_KEY, status.SerializeToString()))
    return tuple(md)


async def abort_denied(
    context: grpc.aio.ServicerContext[object, object], decision: Decision
) -> NoReturn:
    """Abort the RPC with RESOURCE_EXHAUSTED for a denied decision."""
    await context.abort(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        decision.message(),
        trailing_metadata=denial_metadata(decision),
    )
    raise AssertionError("context.abort returned")  # pragma: no cover


def _pack(message: error_details_pb2.QuotaFailure | error_details_pb2.RetryInfo) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)
    return packed
