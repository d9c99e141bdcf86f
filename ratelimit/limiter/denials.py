"""Local memory of request-rate denials, so a refused tenant is refused cheaply.

``RateLimiter`` records every denial here and offers ``known_denial(tenant)``,
which a caller checks before any expensive work (the gateway: before the
tokenizer call).

When Redis says a tenant's *request* bucket is empty (whatever else was short
too), no request of that tenant can pass before that bucket has refilled one
request: it refills at a fixed rate and nothing refunds it (settling refunds
tokens, never requests; other gateway replicas only take more). So until then
this process can answer RESOURCE_EXHAUSTED itself, without a Redis round trip
and before the tokenizer, with the remaining wait. A flood over the request
rate therefore costs one tokenizer call per refill interval, not one per
request.

It never admits anything Redis would refuse, only refuses locally what Redis
would refuse too. Two things can make it refuse a little too long, both
bounded by one request's refill time (60 s / requests_per_minute): an admin
ResetLimits, and a raised limit (a changed policy drops the memo as soon as
the gateway's tenant cache sees it). Token and concurrency denials without a
request shortage are not memoised: refunds and lease releases can end them
early.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Callable
from typing import Any

from ratelimit.config import Dimension, LimitPolicy
from ratelimit.limiter.algorithm import refill, wait_ms
from ratelimit.limiter.decision import Decision


def _keep_newest(entries: dict[str, Any], keep: int) -> None:
    """Forget all but the ``keep`` newest entries (callers re-insert a key when they
    update it, so insertion order is age); no sort, no scan beyond what goes."""
    for key in list(itertools.islice(entries, max(0, len(entries) - keep))):
        del entries[key]


@dataclasses.dataclass(slots=True, frozen=True)
class _Memo:
    until: float  # clock seconds
    decision: Decision
    policy: LimitPolicy


class DenialMemo:
    """Per-tenant request-rate denials, valid until their bucket refills."""

    def __init__(
        self, clock: Callable[[], float] = time.monotonic, max_tenants: int = 10_000
    ) -> None:
        self._clock = clock
        self._max = max_tenants
        self._memos: dict[str, _Memo] = {}

    def record(self, tenant_id: str, policy: LimitPolicy, decision: Decision) -> None:
        """Remember a denial whose request bucket was short, until it refills one request.

        The wait is the request bucket's own (at the rate of the policy that decided,
        the fail-open share included), not the decision's: a token or concurrency
        shortage can end early (refunds, releases), the request one cannot.
        """
        rpm = decision.policy.requests_per_minute
        if decision.allowed or not decision.denied & Dimension.REQUESTS or rpm <= 0:
            return
        wait = wait_ms(1 - max(0.0, decision.requests_remaining), rpm)
        self._memos.pop(tenant_id, None)  # re-inserted below: insertion order is age
        if len(self._memos) >= self._max:
            self._prune()
        until = self._clock() + wait / 1000
        only_requests = dataclasses.replace(
            decision, denied=Dimension.REQUESTS, retry_after_ms=wait
        )
        self._memos[tenant_id] = _Memo(until, only_requests, policy)

    def check(self, tenant_id: str, policy: LimitPolicy) -> Decision | None:
        """The memoised denial with its remaining wait, or None (ask Redis)."""
        memo = self._memos.get(tenant_id)
        if memo is None:
            return None
        # rounded up: a client told to wait must never come back too early
        left_ms = math.ceil(round((memo.until - self._clock()) * 1000, 3))
        if left_ms <= 0 or memo.policy != policy:
            del self._memos[tenant_id]
            return None
        return dataclasses.replace(memo.decision, retry_after_ms=left_ms)

    def _prune(self) -> None:
        """Drop expired memos, then the oldest until half full: the next full scan is
        ``max_tenants / 2`` denials away."""
        now = self._clock()
        for tid in [t for t, m in self._memos.items() if m.until <= now]:
            del self._memos[tid]
        _keep_newest(self._memos, self._max // 2)


@dataclasses.dataclass(slots=True, frozen=True)
class _Seen:
    at: float  # clock seconds
    requests_left: float  # -1 = unlimited
    leases: int
    policy: LimitPolicy
    tokens_left: float = -1.0  # -1 = unlimited


class HeadroomMemo:
    """Per-tenant request and concurrency headroom as of the last admission this
    process saw, so a caller can tell when one combined store call (request unit,
    lease and tokens, after the tokenizer) is all but sure not to be refused for the
    request rate or concurrency, and a caller near its limits still gets the
    two-call path that refuses it before the tokenizer.

    The estimate is this process's view: the request bucket refills at its rate
    from the level last seen, leases as last seen. Other gateway replicas take from
    the same buckets, so it can be optimistic; ``margin`` requests (and leases) of
    headroom are required, and a wrong guess costs one tokenizer call for a request
    that is then refused exactly as before (the store decides, never this memo).
    """

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        max_tenants: int = 10_000,
        margin: float = 2.0,
    ) -> None:
        self._clock = clock
        self._max = max_tenants
        self.margin = margin
        self._seen: dict[str, _Seen] = {}

    def record(self, tenant_id: str, policy: LimitPolicy, decision: Decision) -> None:
        """Note an admission's levels (denials are the DenialMemo's; they clear this)."""
        if not decision.allowed:
            self._seen.pop(tenant_id, None)
            return
        self._seen.pop(tenant_id, None)  # re-inserted below: insertion order is age
        if len(self._seen) >= self._max:
            _keep_newest(self._seen, self._max // 2)
        self._seen[tenant_id] = _Seen(
            self._clock(),
            decision.requests_remaining,
            decision.concurrent_in_use,
            policy,
            decision.tokens_remaining,
        )

    def forget(self, tenant_id: str) -> None:
        """Drop what was seen of the tenant (the store failed: its levels are unknown)."""
        self._seen.pop(tenant_id, None)

    def has_headroom(self, tenant_id: str, policy: LimitPolicy) -> bool:
        """True when the last admission left at least ``margin`` requests (refilled
        since at the policy's rate) and ``margin`` free leases, under this policy."""
        seen = self._seen.get(tenant_id)
        if seen is None or seen.policy != policy:
            return False
        requests = _level(
            seen.requests_left,
            policy.request_capacity,
            policy.requests_per_minute,
            self._clock() - seen.at,
        )
        if requests < self.margin:
            return False
        return not (policy.max_concurrent > 0 and policy.max_concurrent - seen.leases < self.margin)

    def claim(self, tenant_id: str, policy: LimitPolicy, num_tokens: int) -> bool:
        """Whether a request of ``num_tokens`` may start before the store confirms it:
        ``has_headroom`` and, refilled since, ``num_tokens`` left in the token bucket.
        A claim spends from this estimate at once (one request, one lease, the
        tokens), so a burst of claims never adds up to more than the memo last saw;
        the store's next answer for the tenant replaces the estimate."""
        if not self.has_headroom(tenant_id, policy):
            return False
        seen, now = self._seen[tenant_id], self._clock()
        tokens = _level(
            seen.tokens_left, policy.token_capacity, policy.tokens_per_minute, now - seen.at
        )
        if tokens < num_tokens:
            return False
        requests = _level(
            seen.requests_left, policy.request_capacity, policy.requests_per_minute, now - seen.at
        )
        self._seen[tenant_id] = dataclasses.replace(
            seen,
            at=now,
            requests_left=seen.requests_left if math.isinf(requests) else requests - 1,
            leases=seen.leases + 1,
            tokens_left=seen.tokens_left if math.isinf(tokens) else tokens - num_tokens,
        )
        return True


def _level(left: float, capacity: int, per_minute: int, elapsed_s: float) -> float:
    """A level the store reported (-1 = unlimited), refilled over ``elapsed_s``;
    infinity when unlimited."""
    if left < 0:
        return math.inf
    return refill(left, capacity, per_minute, elapsed_s * 1000.0)
