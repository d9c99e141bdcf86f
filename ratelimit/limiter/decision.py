"""What ``RateLimiter.reserve`` returns: a decision and, when admitted, a reservation."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ratelimit.config import Dimension, LimitPolicy
from ratelimit.limiter.algorithm import UNLIMITED, Outcome


@dataclass(slots=True)
class Reservation:
    """What an admitted request holds until ``settle``/``release``.

    Attributes:
        tenant_id: The tenant charged.
        lease_id: Id of the concurrency lease (heartbeat it while streaming).
        policy: The policy the reservation was taken under (the fallback
            share when ``source`` is ``"local"``); settle refunds against it.
        num_tokens: Tokens taken from the bucket (0 when shadow mode admitted
            a request the limits would have denied: nothing was taken).
        holds_lease: False for shadow-denied requests (no lease was added).
        source: ``"redis"`` or ``"local"`` (fail-open fallback).
        settled: Set by the limiter; settling twice is a no-op.
    """

    tenant_id: str
    lease_id: str
    policy: LimitPolicy
    num_tokens: int
    holds_lease: bool
    source: str
    settled: bool = False


@dataclass(frozen=True, slots=True)
class Decision:
    """The outcome of one admission check.

    Attributes:
        allowed: Proceed (True also for shadow-mode admissions of over-limit requests).
        retry_after_ms: When denied, the earliest time the same request can
            pass (-1: never, it needs more tokens than the bucket holds).
        denied: Every dimension that was short (also set when shadow-denied).
        reservation: Present when allowed; pass it to settle/release.
        requests_remaining: Request-bucket level after the decision (-1 = unlimited).
        tokens_remaining: Token-bucket level after the decision (-1 = unlimited).
        concurrent_in_use: Live leases after the decision.
        source: ``"redis"``, ``"memory"`` or ``"local"`` (fail-open fallback).
        shadow_denied: Shadow mode admitted a request the limits would deny.
        server_time_ms: Clock reading of the decision (Redis TIME).
        tenant_id: The tenant checked.
        num_tokens: Tokens asked for.
        policy: The policy applied.
    """

    allowed: bool
    retry_after_ms: int
    denied: Dimension
    reservation: Reservation | None
    requests_remaining: float
    tokens_remaining: float
    concurrent_in_use: int
    source: str
    shadow_denied: bool
    server_time_ms: float
    tenant_id: str
    num_tokens: int
    policy: LimitPolicy

    @classmethod
    def from_outcome(
        cls,
        tenant_id: str,
        policy: LimitPolicy,
        outcome: Outcome,
        lease_id: str,
        num_tokens: int,
        source: str,
    ) -> Decision:
        """The decision (and reservation, when admitted) for a store outcome."""
        reservation = None
        if outcome.allowed:
            reservation = Reservation(
                tenant_id=tenant_id,
                lease_id=lease_id,
                policy=policy,
                num_tokens=num_tokens if outcome.taken else 0,
                holds_lease=outcome.taken,
                source=source,
            )
        return cls(
            allowed=outcome.allowed,
            retry_after_ms=outcome.retry_after_ms,
            denied=outcome.denied,
            reservation=reservation,
            requests_remaining=outcome.requests_left,
            tokens_remaining=outcome.tokens_left,
            concurrent_in_use=outcome.num_leases,
            source=source,
            shadow_denied=outcome.shadow_denied,
            server_time_ms=outcome.now_ms,
            tenant_id=tenant_id,
            num_tokens=num_tokens,
            policy=policy,
        )

    @property
    def lease_id(self) -> str | None:
        """The lease id of an admitted request that holds a lease."""
        r = self.reservation
        return r.lease_id if r is not None and r.holds_lease else None

    def violations(self) -> list[tuple[str, str]]:
        """(subject, description) per short dimension, for ``QuotaFailure`` details."""
        out: list[tuple[str, str]] = []
        p = self.policy
        if Dimension.REQUESTS in self.denied:
            out.append(
                (
                    "requests_per_minute",
                    f"limit {p.requests_per_minute} requests/min "
                    f"(burst {p.request_capacity}); "
                    f"{_level(self.requests_remaining)} available",
                )
            )
        if Dimension.TOKENS in self.denied:
            if self.num_tokens > p.token_capacity:
                text = (
                    f"the request needs {self.num_tokens} tokens but the bucket holds at "
                    f"most {p.token_capacity}; lower max_tokens or shorten the prompt"
                )
            else:
                text = (
                    f"limit {p.tokens_per_minute} tokens/min (burst {p.token_capacity}); "
                    f"needs {self.num_tokens}, {_level(self.tokens_remaining)} available"
                )
            out.append(("tokens_per_minute", text))
        if Dimension.CONCURRENCY in self.denied:
            out.append(
                (
                    "max_concurrent",
                    f"limit {p.max_concurrent} concurrent requests; "
                    f"{self.concurrent_in_use} in flight",
                )
            )
        return out

    def message(self) -> str:
        """A sentence a person can act on."""
        if not self.denied:
            return f"tenant {self.tenant_id!r} is within its limits"
        parts = "; ".join(f"{subject}: {text}" for subject, text in self.violations())
        if self.retry_after_ms < 0:
            retry = "this request can never fit"
        else:
            retry = f"retry after {self.retry_after_ms} ms"
        return f"tenant {self.tenant_id!r} is over its rate limit ({parts}); {retry}"


def _level(value: float) -> str:
    return "unlimited" if value == UNLIMITED else str(math.floor(max(value, 0.0)))
