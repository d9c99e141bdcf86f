"""Request bodies still arriving: a cap per tenant and a time limit on each.

The HTTP front checks the key before it reads a body, so a body is read for a
known tenant. Until the body is in, nothing of the tenant's limits is held (the
lease is taken once the prompt is known), so a slow body would be free: a
tenant could park any number of connections sending a byte now and then. Here
each tenant may have at most ``max_per_tenant`` bodies arriving on this gateway
process at once (fewer when its ``max_concurrent`` is lower: a tenant allowed one
request at a time gets one body at a time), and each body must be in within
``timeout_s``; past either the request gets an answer (429 / 408), and the
HTTP front closes a connection whose body it did not read (no lingering read).
A body that is in within ``BODY_GRACE_S`` of its headers (clients send a small
body right behind them, often in a write of its own) takes no slot: a burst of
ordinary requests is never refused for the bodies of its own requests. Only a
body still arriving past the grace counts, so a connection that trickles costs
the gateway at most the grace before the cap applies to it.
"""

from __future__ import annotations

import asyncio
import contextlib

from aiohttp import web

from gateway.fronts.http.errors import ApiError
from ratelimit.config import Tenant

BODY_RETRY_MS = 1000  # a 429 for too many bodies arriving: one body's worth of waiting
BODY_GRACE_S = 0.2  # a body in this soon after its headers never takes a slot


class BodyGate:
    """Bodies arriving per tenant, each within a time limit.

    Args:
        timeout_s: Longest a request body may take to arrive (0 = no limit).
        max_per_tenant: Bodies one tenant may have arriving at once (0 = no cap).
    """

    def __init__(self, timeout_s: float = 10.0, max_per_tenant: int = 4) -> None:
        self.timeout_s = timeout_s
        self.max_per_tenant = max_per_tenant
        self._arriving: dict[str, int] = {}

    def cap(self, tenant: Tenant) -> int:
        """How many bodies ``tenant`` may have arriving at once (0 = no cap)."""
        caps = [c for c in (self.max_per_tenant, tenant.limits.max_concurrent) if c > 0]
        return min(caps, default=0)

    def arriving(self, tenant_id: str) -> int:
        """Bodies of ``tenant_id`` being read now."""
        return self._arriving.get(tenant_id, 0)

    async def read(self, request: web.Request, tenant: Tenant) -> None:
        """Read the request's body (aiohttp keeps it for ``request.json()``).

        Raises:
            ApiError: 429 when the tenant already has its cap of bodies arriving,
                408 when the body did not arrive in time.
        """
        if request.content.is_eof():  # the whole body is in already: nothing arrives
            await request.read()
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s if self.timeout_s else None
        grace = min(BODY_GRACE_S, self.timeout_s) if self.timeout_s else BODY_GRACE_S
        body = asyncio.ensure_future(request.read())
        try:
            await asyncio.wait({body}, timeout=grace)
            if body.done():
                body.result()  # its error, if any
                return
            await self._arriving_past_grace(tenant, body, deadline)
        finally:
            if not body.done():
                body.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await body

    async def _arriving_past_grace(
        self, tenant: Tenant, body: asyncio.Future[bytes], deadline: float | None
    ) -> None:
        """Wait for ``body`` in one of the tenant's slots (429 when none is free), until
        ``deadline`` (408 past it)."""
        tid, cap = tenant.tenant_id, self.cap(tenant)
        num = self.arriving(tid)
        if cap and num >= cap:
            raise ApiError(
                429,
                f"tenant {tid!r} already has {num} request bodies arriving on this gateway "
                f"(at most {cap} at once); send the body with the request",
                type="rate_limit_error",
                code="too_many_bodies_arriving",
                retry_after_ms=BODY_RETRY_MS,
                should_retry=True,
            )
        self._arriving[tid] = num + 1
        try:
            async with asyncio.timeout_at(deadline):
                await asyncio.shield(body)
        except TimeoutError:
            raise ApiError(
                408,
                f"the request body did not arrive within {self.timeout_s:g} s",
                code="body_timeout",
            ) from None
        finally:
            left = self._arriving[tid] - 1
            if left:
                self._arriving[tid] = left
            else:
                del self._arriving[tid]
