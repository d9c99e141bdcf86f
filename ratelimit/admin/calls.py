"""The one wrapper of admin RPCs (RateLimitAdmin and the gateway's RoutingAdmin):
authenticate the admin key, run the call as that admin, map errors to a status."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc
from prometheus_client import Counter

from common.log import get_logger
from ratelimit.status import status_for
from ratelimit.tenancy.bearer import metadata_bearer
from ratelimit.tenancy.records import KeyRole
from ratelimit.tenancy.registry import Registry

log = get_logger(__name__)
R = TypeVar("R")


async def run_admin_call(
    registry: Registry,
    context: grpc.aio.ServicerContext[Any, Any],
    method: str,
    fn: Callable[[str], Awaitable[R]],
    *,
    counter: Counter | None = None,
) -> R:
    """Authenticate ``authorization: Bearer <admin key>``, return ``await fn(admin key id)``.

    Any error aborts the call with ``status_for``'s code and message (INTERNAL ones are
    logged with their traceback); ``counter`` (labels method, code) counts every call.
    """
    try:
        principal = await registry.authenticate(
            metadata_bearer(context, "admin key"), KeyRole.ADMIN
        )
        result = await fn(principal.key.key_id)
    except Exception as exc:
        code, message = status_for(exc)
        if code == grpc.StatusCode.INTERNAL:
            log.exception("admin call failed", method=method)
        if counter is not None:
            counter.labels(method, code.name).inc()
        await context.abort(code, message)
        raise AssertionError("unreachable") from exc  # abort() always raises
    if counter is not None:
        counter.labels(method, "OK").inc()
    return result
