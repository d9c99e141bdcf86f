"""Retry rules before the first token: which failures, how long to wait, how many.

Retries happen only while no token of the attempt reached the client, only
for failures that say "this replica, not this request" (UNAVAILABLE, which
covers connect errors and draining replicas, and the engine's own
RESOURCE_EXHAUSTED: its queue is full), always on another replica, with
full-jitter exponential backoff, under a max-attempts cap and one deadline
for all attempts. The ``RetryBudget`` keeps retries at most ``ratio`` of the
requests in a rolling window (plus a small floor so a quiet gateway can
still retry), the Finagle/Envoy retry-budget idea: during a wide outage
retries cannot multiply the load.
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import grpc

RETRYABLE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED})
# What says something about the replica's health (breaker failures).
REPLICA_FAILURE_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.DATA_LOSS,
    }
)


def is_retryable(code: grpc.StatusCode) -> bool:
    """True for failures another replica may not have (before any token was sent)."""
    return code in RETRYABLE_CODES


def breaker_verdict(code: grpc.StatusCode | None) -> bool | None:
    """What an engine call's ending says about the replica: True ok, False sick, None nothing.

    DEADLINE_EXCEEDED is the request's own deadline (the engine gets it), so it
    is neutral, like client cancels, queue-full answers and invalid input.
    """
    if code is None or code == grpc.StatusCode.OK:
        return True
    if code in REPLICA_FAILURE_CODES:
        return False
    return None


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Attempts cap and backoff (the defaults are ``GatewayConfig``'s).

    Attributes:
        max_attempts: Engine attempts per request before the first token (1 = no retry).
        backoff_base_s: Base of the exponential backoff.
        backoff_max_s: Cap of one backoff.
    """

    max_attempts: int
    backoff_base_s: float
    backoff_max_s: float

    def backoff(self, retry_index: int, rng: Callable[[], float] = random.random) -> float:
        """Full-jitter delay before retry ``retry_index`` (0 = the first retry)."""
        cap = min(self.backoff_max_s, self.backoff_base_s * float(2**retry_index))
        return float(cap * rng())


class RetryBudget:
    """Retries allowed: ``min_retries + ratio * requests`` in a rolling window (the
    defaults are ``GatewayConfig``'s).

    Args:
        ratio: Share of requests that may be retried (0.2 = at most 20% extra load).
        min_retries: Retries always allowed per window.
        window_s: Length of the window in seconds.
        clock: Monotonic seconds (injectable for tests).
    """

    def __init__(
        self,
        ratio: float,
        min_retries: int,
        window_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ratio = ratio
        self.min_retries = min_retries
        self.window_s = window_s
        self._clock = clock
        self._requests: deque[float] = deque()
        self._retries: deque[float] = deque()

    def _prune(self, now: float) -> None:
        edge = now - self.window_s
        for q in (self._requests, self._retries):
            while q and q[0] < edge:
                q.popleft()

    def record_request(self) -> None:
        """Count one new request (not a retry)."""
        now = self._clock()
        self._prune(now)
        self._requests.append(now)

    def try_withdraw(self) -> bool:
        """Take one retry from the budget; False when the budget is spent."""
        now = self._clock()
        self._prune(now)
        if len(self._retries) + 1 > self.min_retries + self.ratio * len(self._requests):
            return False
        self._retries.append(now)
        return True

    @property
    def num_retries(self) -> int:
        """Retries in the current window."""
        self._prune(self._clock())
        return len(self._retries)
