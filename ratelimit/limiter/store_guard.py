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

from common.log import get_logger
from ratelimit import metrics
from ratelimit.errors import StoreError
from ratelimit.limiter.breaker import BreakerState, CircuitBreaker

log = get_logger(__name__)
T = TypeVar("T")


def log_breaker_change(state: BreakerState) -> None:
    """Export the breaker state and log the transition."""
    metrics.BREAKER_STATE.set(int(state))
    if state == BreakerState.CLOSED:
        log.info("redis circuit breaker closed; limits are shared again")
    else:
        log.warning("redis circuit breaker " + state.name.lower().replace("_", "-"))


class StoreGuard:
    """Runs store calls within a time budget, through a breaker.

    Args:
        timeout_ms: Budget of one call, connection set-up included.
        breaker: The breaker; default 3 failures, 2 s open.
    """

    def __init__(self, timeout_ms: int, breaker: CircuitBreaker | None = None) -> None:
        self.timeout_s = timeout_ms / 1000.0
        self.breaker = breaker or CircuitBreaker(3, 2000, on_change=log_breaker_change)

    async def call(self, op: str, fn: Callable[[], Awaitable[T]]) -> T:
        """Run ``fn()``; raise ``StoreError`` on error, timeout or open breaker."""
        if not self.breaker.allow():
            raise StoreError(f"redis circuit breaker is open (skipping {op})")
        try:
            async with asyncio.timeout(self.timeout_s):
                result = await fn()
        except TimeoutError:
            self._failed(op, "timeout", "timed out")
            raise StoreError(
                f"redis {op} took longer than {self.timeout_s * 1000:.0f} ms"
            ) from None
        except StoreError as exc:
            self._failed(op, "error", str(exc))
            raise
        except asyncio.CancelledError:
            self.breaker.cancel_probe()
            raise
        self.breaker.record_success()
        return result

    def _failed(self, op: str, kind: str, error: str) -> None:
        metrics.STORE_ERRORS.labels(op, kind).inc()
        self.breaker.record_failure()
        log.warning(
            "redis call failed",
            op=op,
            kind=kind,
            error=error,
            consecutive_failures=self.breaker.num_failures,
        )
