"""The limiter's state in process memory: unit tests and the fail-open fallback.

Same algorithm as the Redis script (``ratelimit.limiter.algorithm``), same clock
semantics (an injected millisecond clock), no I/O. Single event loop only:
every method runs without an ``await`` in the middle, so it is atomic there.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from ratelimit.config import Dimension, LimitPolicy
from ratelimit.limiter import algorithm
from ratelimit.limiter.algorithm import BucketState, Outcome
from ratelimit.limiter.storage import UsageSnapshot


def wall_clock_ms() -> float:
    """Unix time in milliseconds."""
    return time.time() * 1000.0


@dataclass(slots=True)
class _TenantState:
    bucket: BucketState | None = None
    leases: dict[str, float] = field(default_factory=dict)  # lease_id -> expiry ms
    takes: dict[str, int] = field(default_factory=dict)  # lease_id -> tokens ``take`` took
    totals: Counter[str] = field(default_factory=Counter)

    def expire_leases(self, now_ms: float) -> None:
        for lease_id in [k for k, expiry in self.leases.items() if expiry <= now_ms]:
            del self.leases[lease_id]
            self.takes.pop(lease_id, None)


class MemoryStore:
    """A ``Store`` in a dict, with an injected clock (milliseconds)."""

    name = "memory"

    def __init__(
        self,
        *,
        lease_ttl_ms: int,
        concurrency_retry_ms: int,
        clock: Callable[[], float] = wall_clock_ms,
    ) -> None:
        self.lease_ttl_ms = lease_ttl_ms
        self.concurrency_retry_ms = concurrency_retry_ms
        self.clock = clock
        self._tenants: dict[str, _TenantState] = {}

    def _state(self, tenant_id: str) -> _TenantState:
        return self._tenants.setdefault(tenant_id, _TenantState())

    async def reserve(
        self,
        tenant_id: str,
        policy: LimitPolicy,
        *,
        num_tokens: int,
        lease_id: str,
        shadow: bool,
    ) -> Outcome:
        """See ``Store.reserve``."""
        now = self.clock()
        st = self._state(tenant_id)
        st.expire_leases(now)
        outcome, st.bucket = algorithm.decide(
            policy,
            st.bucket,
            now,
            num_tokens=num_tokens,
            num_leases=len(st.leases),
            first_lease_expiry_ms=min(st.leases.values(), default=None),
            shadow=shadow,
            concurrency_retry_ms=self.concurrency_retry_ms,
        )
        if outcome.taken:
            st.leases[lease_id] = now + self.lease_ttl_ms
            st.totals["requests"] += 1
        elif outcome.shadow_denied:
            st.totals["requests"] += 1
            st.totals["shadow_denied"] += 1
        else:
            st.totals["denied"] += 1
        return outcome

    async def take(
        self,
        tenant_id: str,
        policy: LimitPolicy,
        *,
        num_tokens: int,
        lease_id: str,
        shadow: bool,
    ) -> Outcome:
        """See ``Store.take``."""
        now = self.clock()
        st = self._state(tenant_id)
        st.expire_leases(now)
        if lease_id in st.takes:  # a retried call: taken already
            req, tok = algorithm.levels_at(policy, st.bucket, now)
            return Outcome(
                True,
                Dimension.NONE,
                0,
                algorithm.reported(req),
                algorithm.reported(tok),
                len(st.leases),
                now,
            )
        outcome, st.bucket = algorithm.take(
            policy, st.bucket, now, num_tokens=num_tokens, num_leases=len(st.leases), shadow=shadow
        )
        if outcome.taken and num_tokens and policy.tokens_per_minute:
            st.takes[lease_id] = num_tokens
        elif outcome.shadow_denied:
            st.totals["shadow_denied"] += 1
        elif not outcome.allowed:
            st.totals["denied"] += 1
        return outcome

    async def settle(
        self,
        tenant_id: str,
        policy: LimitPolicy,
        *,
        lease_id: str,
        refund_tokens: int,
        prompt_tokens: int,
        completion_tokens: int,
        only_if_held: bool = False,
        refund_take: bool = True,
    ) -> bool:
        """See ``Store.settle``."""
        st = self._state(tenant_id)
        held = st.leases.pop(lease_id, None) is not None
        if only_if_held and not held:
            refund_tokens = 0
        taken = st.takes.pop(lease_id, 0)
        refund_tokens += taken if refund_take else 0
        if refund_tokens:
            st.bucket = algorithm.refund(policy, st.bucket, self.clock(), refund_tokens)
        st.totals["prompt_tokens"] += max(prompt_tokens, 0)
        st.totals["completion_tokens"] += max(completion_tokens, 0)
        return held

    async def heartbeat(self, tenant_id: str, lease_id: str) -> bool:
        """See ``Store.heartbeat``."""
        now = self.clock()
        st = self._state(tenant_id)
        expiry = st.leases.get(lease_id)
        if expiry is None or expiry <= now:
            return False
        st.leases[lease_id] = now + self.lease_ttl_ms
        return True

    async def usage(self, tenant_id: str, policy: LimitPolicy) -> UsageSnapshot:
        """See ``Store.usage``."""
        now = self.clock()
        st = self._tenants.get(tenant_id) or _TenantState()
        req, tok = algorithm.levels_at(policy, st.bucket, now)
        return UsageSnapshot(
            requests_available=algorithm.reported(req),
            tokens_available=algorithm.reported(tok),
            concurrent_in_use=sum(1 for e in st.leases.values() if e > now),
            requests_total=st.totals["requests"],
            prompt_tokens_total=st.totals["prompt_tokens"],
            completion_tokens_total=st.totals["completion_tokens"],
            requests_denied_total=st.totals["denied"],
            shadow_denials_total=st.totals["shadow_denied"],
        )

    async def reset(self, tenant_id: str) -> None:
        """See ``Store.reset``."""
        self._state(tenant_id).bucket = None

    async def forget(self, tenant_id: str) -> None:
        """See ``Store.forget``."""
        self._tenants.pop(tenant_id, None)

    async def close(self) -> None:
        """Nothing to release."""
