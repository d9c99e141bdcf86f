"""Time budget + circuit breaker + metrics around every call to the shared store.

Envoy's ratelimit service waits on Redis for as long as Redis takes; here a
call gets ``timeout_ms`` and then counts as a failure, and after
``breaker_failures`` failures in a row the store is skipped entirely until a
probe succeeds. Every failure surfaces as ``StoreError``, the one error the
limiter maps to its fail mode.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from common.breaker import BreakerPolicy, BreakerState, CircuitBreaker
from common.log import get_logger
from ratelimit import metrics
from ratelimit.errors import BreakerOpenError, StoreError

log = get_logger(__name__)
T = TypeVar("T")


def log_breaker_change(name: str, state: BreakerState) -> None:
    """Export the breaker state and log the transition."""
    metrics.BREAKER_STATE.set(int(state))
    if state == BreakerState.CLOSED:
        log.info("redis circuit breaker closed; limits are shared again")
    else:
        log.warning("redis circuit breaker " + state.name.lower().replace("_", "-"))


def store_breaker(
    failures: int,
    open_ms: int,
    *,
    clock_ms: Callable[[], float] | None = None,
    on_change: Callable[[str, BreakerState], None] | None = log_breaker_change,
) -> CircuitBreaker:
    """The breaker around Redis: open after ``failures`` failures in a row, skip the store
    for ``open_ms``, then let one probe through. ``clock_ms``: monotonic milliseconds."""
    policy = BreakerPolicy.consecutive(failures, open_ms / 1000.0)
    if clock_ms is None:
        return CircuitBreaker("redis", policy, on_change=on_change)
    ms = clock_ms
    return CircuitBreaker("redis", policy, clock=lambda: ms() / 1000.0, on_change=on_change)


class StoreGuard:
    """Runs store calls within a time budget, through a breaker.

    Args:
        timeout_ms: Budget of one call, connection set-up included.
        breaker: The breaker; default 3 failures, 2 s open.
    """

    def __init__(self, timeout_ms: int, breaker: CircuitBreaker | None = None) -> None:
        self.timeout_s = timeout_ms / 1000.0
        self.breaker = breaker or store_breaker(3, 2000)

    async def call(self, op: str, fn: Callable[[], Awaitable[T]]) -> T:
        """Run ``fn()``; raise ``StoreError`` on error, timeout or open breaker."""
        ticket = self.breaker.admit()
        if ticket is None:
            raise BreakerOpenError(f"redis circuit breaker is open (skipping {op})")
        try:
            async with asyncio.timeout(self.timeout_s):
                result = await fn()
        except TimeoutError:
            self.breaker.record(False, ticket)
            self._failed(op, "timeout", "timed out")
            raise StoreError(
                f"redis {op} took longer than {self.timeout_s * 1000:.0f} ms"
            ) from None
        except StoreError as exc:
            self.breaker.record(False, ticket)
            self._failed(op, "error", str(exc))
            raise
        except asyncio.CancelledError:
            self.breaker.record(None, ticket)  # says nothing about the store; frees a probe
            raise
        self.breaker.record(True, ticket)
        return result

    def _failed(self, op: str, kind: str, error: str) -> None:
        metrics.STORE_ERRORS.labels(op, kind).inc()
        log.warning(
            "redis call failed",
            op=op,
            kind=kind,
            error=error,
            consecutive_failures=self.breaker.consecutive_failures,
        )
