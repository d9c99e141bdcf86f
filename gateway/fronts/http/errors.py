"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` plus the HTTP status.

The pipeline speaks ``grpc.StatusCode`` (docs/architecture.md); this module is the one
place that maps it to HTTP, the way OpenAI's SDKs classify it:

    INVALID_ARGUMENT   400 invalid_request_error  (param when the field is known)
    UNAUTHENTICATED    401 authentication_error   invalid_api_key
    PERMISSION_DENIED  403 permission_error       permission_denied
    NOT_FOUND          404 invalid_request_error  model_not_found (param "model")
    RESOURCE_EXHAUSTED 429 rate_limit_error       rate_limit_exceeded  (a tenant limit:
                                                  QuotaFailure details; Retry-After)
                       429 rate_limit_error       engine_overloaded    (every engine full)
                       429 rate_limit_error       auth_throttled       (failed-auth throttle)
    UNAVAILABLE        503 service_unavailable    service_unavailable
    DEADLINE_EXCEEDED  504 timeout_error          deadline_exceeded
    anything else      500 server_error

``Retry-After`` carries whole seconds (rounded up); ``retry-after-ms`` the
exact wait (the OpenAI SDKs prefer it). Overload is 429, never 503: Envoy
retries a 503 on another replica (a draining one), and retrying "every engine
is full" or a throttled address would only multiply the load that refused it.
``x-should-retry: false`` tells the SDKs not to retry a limit that waiting
cannot satisfy.
"""

from __future__ import annotations

import math
import re
from typing import Any

import grpc

from gateway.domain import GatewayError

_MAP: dict[grpc.StatusCode, tuple[int, str, str | None]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error", "invalid_value"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error", "invalid_api_key"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error", "permission_denied"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error", "model_not_found"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "rate_limit_exceeded"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable", "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error", "deadline_exceeded"),
    grpc.StatusCode.CANCELLED: (499, "cancelled", "cancelled"),
}
_THROTTLED = "failed authentications"  # the failed-auth throttle's message
OVERLOAD_RETRY_MS = 1000  # an overload answer without a wait of its own
_SAMPLING_FIELD = re.compile(r"\bsampling\.([a-z_]+)")
# pipeline field names -> OpenAI request fields (chat / completions)
_PARAMS = {
    "logprobs": ("top_logprobs", "logprobs"),
    "stop_token_ids": ("stop_token_ids",) * 2,
    "guided": ("response_format", "response_format"),
}
_TOOL_FIELD = re.compile(r"^(tools\[\d+\]|tools|tool_choice)\b")


class ApiError(Exception):
    """An HTTP error answer in OpenAI's shape.

    Attributes:
        status: HTTP status code.
        message: A sentence a person can act on.
        type: OpenAI error type (``invalid_request_error``, ``rate_limit_error``, ...).
        param: The request field at fault, when one is.
        code: A stable machine-readable code.
        retry_after_ms: Sets ``Retry-After``/``retry-after-ms`` when not None.
        should_retry: Sets ``x-should-retry`` when not None.
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry_after_ms: int | None = None,
        should_retry: bool | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.retry_after_ms = retry_after_ms
        self.should_retry = should_retry

    @classmethod
    def invalid(cls, param: str | None, message: str) -> ApiError:
        """A 400 naming the field at fault."""
        return cls(400, message, param=param, code="invalid_value")

    @classmethod
    def from_gateway(cls, e: GatewayError, *, chat: bool = True) -> ApiError:
        """The HTTP answer for a pipeline error (``chat`` picks the request's field names)."""
        status, type_, code = _MAP.get(e.code, (500, "server_error", "internal_error"))
        message = e.message.replace("sampling.", "")
        retry_ms = e.retry_after_ms
        should_retry: bool | None = None
        if e.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            if not e.trailers:  # no QuotaFailure: not the tenant's limit
                code = "auth_throttled" if _THROTTLED in e.message else "engine_overloaded"
                retry_ms = OVERLOAD_RETRY_MS if retry_ms is None else retry_ms
            should_retry = retry_ms is not None
        return cls(
            status,
            message,
            type=type_,
            param=_param(e, chat),
            code=code,
            retry_after_ms=retry_ms,
            should_retry=should_retry,
        )

    def body(self) -> dict[str, Any]:
        """The JSON body."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def headers(self) -> dict[str, str]:
        """Retry headers for the response."""
        out: dict[str, str] = {}
        if self.retry_after_ms is not None:
            out["Retry-After"] = str(max(1, math.ceil(self.retry_after_ms / 1000)))
            out["retry-after-ms"] = str(self.retry_after_ms)
        if self.should_retry is not None:
            out["x-should-retry"] = "true" if self.should_retry else "false"
        return out


def _param(e: GatewayError, chat: bool) -> str | None:
    """The OpenAI field a pipeline error is about, when its message names one."""
    if e.code == grpc.StatusCode.NOT_FOUND or "may not use model" in e.message:
        return "model"
    if e.code != grpc.StatusCode.INVALID_ARGUMENT:
        return None
    if e.message.startswith("n is "):
        return "n"
    tool = _TOOL_FIELD.match(e.message)
    if tool:
        return tool.group(1)
    m = _SAMPLING_FIELD.search(e.message)
    if m:
        names = _PARAMS.get(m.group(1))
        return (names[0] if chat else names[1]) if names else m.group(1)
    if "max_tokens" in e.message:
        return "max_tokens"
    if "prompt" in e.message or "message" in e.message:
        return "messages" if chat else "prompt"
    return None
