"""Where bucket levels, leases and usage totals live, behind one protocol.

``RedisStore`` is the shared state of every gateway replica; ``MemoryStore``
is the same algorithm in process memory, used by unit tests and as the
fail-open fallback. The limiter depends only on ``Store`` (envoy ratelimit
``limiter.RateLimitCache``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from ratelimit.config import LimitPolicy
from ratelimit.limiter.algorithm import Outcome


@dataclass(frozen=True, slots=True)
class UsageSnapshot:
    """Live levels and running totals of one tenant.

    Levels are -1 for a dimension without a limit.
    """

    requests_available: float
    tokens_available: float
    concurrent_in_use: int
    requests_total: int
    prompt_tokens_total: int
    completion_tokens_total: int
    requests_denied_total: int
    shadow_denials_total: int


class Store(Protocol):
    """Atomic per-tenant bucket operations; every method raises ``StoreError`` on failure."""

    name: str
    lease_ttl_ms: int

    async def reserve(
        self,
        tenant_id: str,
        policy: LimitPolicy,
        *,
        num_tokens: int,
        lease_id: str,
        shadow: bool,
    ) -> Outcome:
        """Check and take 1 request, ``num_tokens`` tokens and 1 lease, all or nothing."""
        ...

    async def take(
        self,
        tenant_id: str,
        policy: LimitPolicy,
        *,
        num_tokens: int,
        lease_id: str,
        shadow: bool,
    ) -> Outcome:
        """Check and take ``num_tokens`` more tokens for the request holding ``lease_id``
        (admitted by ``reserve``), remembered per lease. Idempotent per lease."""
        ...

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
        """Refund tokens, drop the lease, add usage; True if the lease was still held.

        ``only_if_held``: refund only when the lease was still there (compensates a
        reserve whose outcome is unknown: it refunds what that reserve took, or
        nothing when it never ran or was already settled).
        ``refund_take``: also give back what ``take`` took for the lease (the caller's
        ``refund_tokens`` never counts it); False keeps it charged.
        """
        ...

    async def heartbeat(self, tenant_id: str, lease_id: str) -> bool:
        """Extend a live lease by the lease TTL; False when it already expired."""
        ...

    async def usage(self, tenant_id: str, policy: LimitPolicy) -> UsageSnapshot:
        """Read levels (refilled to now), live leases and totals without changing them."""
        ...

    async def reset(self, tenant_id: str) -> None:
        """Refill every bucket of the tenant; leases and totals are kept."""
        ...

    async def forget(self, tenant_id: str) -> None:
        """Drop everything stored for the tenant (buckets, leases, totals)."""
        ...

    async def close(self) -> None:
        """Release connections."""
        ...
