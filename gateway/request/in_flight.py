"""The generate requests in flight on this gateway replica, and the drain that waits for them.

Every request enters before its first step and leaves once it has settled; while the
replica drains, a new request is refused (UNAVAILABLE, so the client retries on another
replica) and ``drain`` waits, up to its grace period, for the count to reach zero.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import grpc

from common.log import get_logger
from gateway import metrics
from gateway.domain import GatewayError

log = get_logger(__name__)


class InFlight:
    """The count of requests being served (the ``gateway_in_flight`` gauge too).

    Attributes:
        draining: Set by ``drain``: new requests are refused from then on.
        count: Requests entered and not yet left.
    """

    def __init__(self) -> None:
        self.draining = False
        self.count = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def enter(self) -> None:
        """Count one more request.

        Raises:
            GatewayError: UNAVAILABLE once draining.
        """
        if self.draining:
            raise GatewayError(
                grpc.StatusCode.UNAVAILABLE,
                "this gateway replica is shutting down; retry on another",
            )
        self.count += 1
        self._idle.clear()
        metrics.IN_FLIGHT.inc()

    def leave(self) -> None:
        """Count one request less (once per ``enter`` that returned)."""
        self.count -= 1
        metrics.IN_FLIGHT.dec()
        if self.count == 0:
            self._idle.set()

    async def drain(self, grace_s: float) -> None:
        """Refuse new requests; wait up to ``grace_s`` for the ones in flight."""
        self.draining = True
        log.info("draining", in_flight=self.count, grace_seconds=grace_s)
        started = time.monotonic()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), grace_s)
        if self.count:
            log.warning("drain timed out", in_flight=self.count, grace_seconds=grace_s)
        else:
            log.info("drained", seconds=round(time.monotonic() - started, 3))
