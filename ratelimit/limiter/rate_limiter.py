"""The limiter the gateway calls: reserve -> (heartbeat) -> settle, with failure modes.

    decision = await limiter.reserve(tenant, prompt_tokens + max_tokens)
    if not decision.allowed:  -> RESOURCE_EXHAUSTED, retry-after-ms = decision.retry_after_ms
    async with limiter.keep_alive(decision.reservation):   # heartbeats the lease
        ... stream ...
    await limiter.settle(decision.reservation, prompt_tokens=p, completion_tokens=c)

Redis is the shared store. Each call has a time budget (``timeout_ms``) and
goes through a circuit breaker, so a dead Redis costs the budget only until
the breaker opens. When Redis fails, ``fail_mode`` decides: ``open`` admits
against a per-process ``MemoryStore`` holding the tenant's policy divided by
the number of replicas (so N replicas together stay near the real limit);
``closed`` raises ``LimiterUnavailableError`` (UNAVAILABLE). The breaker's
half-open probe brings Redis back without a restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Awaitable

from common.breaker import CircuitBreaker
from common.log import get_logger
from common.tasks import cancel_and_wait
from ratelimit import metrics
from ratelimit.config import FAIL_MODES, Dimension, LimitPolicy, Tenant
from ratelimit.errors import BreakerOpenError, LimiterUnavailableError, StoreError
from ratelimit.limiter.algorithm import UNLIMITED, Outcome
from ratelimit.limiter.decision import Decision, Reservation
from ratelimit.limiter.denials import DenialMemo, HeadroomMemo
from ratelimit.limiter.storage import Store, UsageSnapshot
from ratelimit.limiter.storage.memory import MemoryStore
from ratelimit.store_guard import StoreGuard

log = get_logger(__name__)
_DIMENSION_NAMES = (
    (Dimension.REQUESTS, "requests"),
    (Dimension.TOKENS, "tokens"),
    (Dimension.CONCURRENCY, "concurrency"),
)


def _admitted_unchecked() -> Outcome:
    """A take admitted without a store answer (no levels known)."""
    return Outcome(True, Dimension.NONE, 0, UNLIMITED, UNLIMITED, 0, time.time() * 1000)


class RateLimiter:
    """Admission control for tenants over a shared ``Store``.

    Args:
        store: The shared store (``RedisStore``).
        fail_mode: ``"open"`` (local fallback buckets) or ``"closed"`` (raise).
        timeout_ms: Budget of one store call.
        num_replicas: Gateway replicas sharing the limits; divides the fallback policy
            until ``set_live_replicas`` reports the live count.
        breaker: Circuit breaker around the store (default: 3 failures, 2 s open).
        fallback: Local store used when failing open (default: a ``MemoryStore``).
    """

    def __init__(
        self,
        store: Store,
        *,
        fail_mode: str = "open",
        timeout_ms: int = 100,
        num_replicas: int = 1,
        breaker: CircuitBreaker | None = None,
        fallback: Store | None = None,
    ) -> None:
        if fail_mode not in FAIL_MODES:
            raise ValueError(f"fail_mode must be one of {FAIL_MODES}, got {fail_mode!r}")
        self.store = store
        self.fail_mode = fail_mode
        self.num_replicas = num_replicas
        self.guard = StoreGuard(timeout_ms, breaker)
        self.breaker = self.guard.breaker
        self._call = self.guard.call
        self.fallback = fallback or MemoryStore(
            lease_ttl_ms=store.lease_ttl_ms, concurrency_retry_ms=1000
        )
        self.denials = DenialMemo()
        self.headroom = HeadroomMemo()
        self._background: set[asyncio.Task[None]] = set()

    def known_denial(self, tenant: Tenant) -> Decision | None:
        """A request-rate denial of ``tenant`` whose bucket has not refilled yet.

        Exact (nothing refunds requests), so a caller may refuse at once, with the
        remaining wait, without a store call. None: ask ``reserve``.
        """
        return self.denials.check(tenant.tenant_id, tenant.limits)

    def has_headroom(self, tenant: Tenant) -> bool:
        """Whether ``tenant`` had, at its last admission here, room for at least a couple
        more requests and leases (``HeadroomMemo``): then one ``reserve`` with the
        tokens, after counting the prompt, is all but sure to pass; otherwise reserve
        the request unit first (a refusal then costs no tokenizer call)."""
        return self.headroom.has_headroom(tenant.tenant_id, tenant.limits)

    def claim_headroom(self, tenant: Tenant, num_tokens: int) -> bool:
        """Whether a request of ``num_tokens`` may start while its ``reserve`` is in
        flight (``HeadroomMemo.claim``: headroom for it, spent from the estimate at
        once). The store still decides; a caller that starts early undoes the work
        when the reservation is refused."""
        return self.headroom.claim(tenant.tenant_id, tenant.limits, num_tokens)

    def set_live_replicas(self, count: int) -> None:
        """The live number of gateway replicas (``ReplicaMembership``): the divisor of
        the fail-open share from now on."""
        self.num_replicas = max(1, count)

    async def reserve(self, tenant: Tenant, num_tokens: int) -> Decision:
        """Admit one request of ``num_tokens`` tokens (prompt + max new tokens) or not.

        Takes 1 request, ``num_tokens`` tokens and 1 concurrency lease in one
        atomic step, or nothing. A denial is a return value, not an exception.

        Raises:
            ValueError: ``num_tokens`` is negative.
            LimiterUnavailableError: the store failed and ``fail_mode`` is closed.
        """
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        lease_id = uuid.uuid4().hex
        start = time.perf_counter()
        policy, source = tenant.limits, self.store.name
        try:
            outcome = await self._call(
                "reserve",
                lambda: self.store.reserve(
                    tenant.tenant_id,
                    policy,
                    num_tokens=num_tokens,
                    lease_id=lease_id,
                    shadow=tenant.shadow_mode,
                ),
            )
        except asyncio.CancelledError:
            self._compensate(tenant, lease_id, num_tokens)  # the script may have run
            raise
        except StoreError as exc:
            if not isinstance(exc, BreakerOpenError):  # else it never reached the store
                self._compensate(tenant, lease_id, num_tokens)
            self.headroom.forget(tenant.tenant_id)  # no engine starts before Redis answers
            self._fail_closed(exc, source)
            policy, source = tenant.limits.fallback_share(self.num_replicas, num_tokens), "local"
            outcome = await self.fallback.reserve(
                tenant.tenant_id,
                policy,
                num_tokens=num_tokens,
                lease_id=lease_id,
                shadow=tenant.shadow_mode,
            )
        metrics.DECISION_SECONDS.labels(source).observe(time.perf_counter() - start)
        decision = self._decision(tenant, policy, outcome, lease_id, num_tokens, source)
        # request and lease levels come with a reserve (a take reports tokens only); a
        # local fallback's levels are not Redis's: nothing may start before Redis answers
        if source != "local":
            self.headroom.record(tenant.tenant_id, tenant.limits, decision)
        return decision

    def _fail_closed(self, exc: StoreError, source: str) -> None:
        """Raise LimiterUnavailableError when this deployment fails closed; else return
        (the caller falls back to the local share)."""
        if self.fail_mode == "closed":
            metrics.DECISIONS.labels("unavailable", source).inc()
            raise LimiterUnavailableError(
                f"rate limiter store unavailable ({exc}); this deployment fails closed, "
                "retry shortly"
            ) from exc

    def _compensate(self, tenant: Tenant, lease_id: str, num_tokens: int) -> None:
        """Undo a reserve whose outcome is unknown (timed out, cancelled, connection lost).

        The store may have taken the tokens and the lease before the answer was lost.
        A settle by lease id that refunds only if that lease exists gives back exactly
        what the reserve took, or nothing; it runs in the background (the caller is
        going away or falling back) and is retried a few times.
        """
        if tenant.shadow_mode:
            return

        async def run() -> None:
            for attempt in range(3):
                try:
                    held = await self._call(
                        "compensate",
                        lambda: self.store.settle(
                            tenant.tenant_id,
                            tenant.limits,
                            lease_id=lease_id,
                            refund_tokens=num_tokens,
                            prompt_tokens=0,
                            completion_tokens=0,
                            only_if_held=True,
                        ),
                    )
                except StoreError:
                    await asyncio.sleep(0.05 * 2**attempt)
                    continue
                metrics.COMPENSATIONS.labels("refunded" if held else "nothing_held").inc()
                return
            metrics.COMPENSATIONS.labels("failed").inc()
            log.warning(
                "could not compensate a reserve with an unknown outcome; its lease "
                "expires after its TTL",
                tenant=tenant.tenant_id,
                lease_id=lease_id,
            )

        task = asyncio.get_running_loop().create_task(run(), name=f"compensate-{lease_id}")
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _decision(
        self,
        tenant: Tenant,
        policy: LimitPolicy,
        outcome: Outcome,
        lease_id: str,
        num_tokens: int,
        source: str,
    ) -> Decision:
        decision = Decision.from_outcome(
            tenant.tenant_id, policy, outcome, lease_id, num_tokens, source
        )
        self.denials.record(tenant.tenant_id, tenant.limits, decision)
        label = "allowed" if outcome.taken else "shadow_denied" if outcome.allowed else "denied"
        metrics.DECISIONS.labels(label, source).inc()
        if outcome.denied != Dimension.NONE:
            for dim, name in _DIMENSION_NAMES:
                if dim & outcome.denied:
                    shadow = str(outcome.allowed).lower()
                    metrics.DENIALS.labels(tenant.tenant_id, name, shadow).inc()
            verb = "shadow-denied" if outcome.allowed else "denied"
            log.info("rate limit " + verb, tenant=tenant.tenant_id, reason=decision.message())
        return decision

    async def settle(
        self, reservation: Reservation, *, prompt_tokens: int, completion_tokens: int
    ) -> None:
        """Finish a request: refund unused tokens, drop its lease, record usage.

        The token bucket is charged exactly ``prompt_tokens + completion_tokens``
        (the unused part of the reservation goes back, never above capacity).
        Idempotent per reservation. A store failure is logged and counted, not
        raised: the lease then expires after its TTL.
        """
        used = prompt_tokens + completion_tokens
        refund = reservation.num_tokens - used if reservation.holds_lease else 0
        await self._finish(reservation, refund, prompt_tokens, completion_tokens)

    async def release(self, reservation: Reservation) -> None:
        """Drop the lease without usage (nothing known): the reserved tokens stay charged."""
        await self._finish(reservation, 0, 0, 0, refund_take=False)

    async def take(self, tenant: Tenant, reservation: Reservation, num_tokens: int) -> Decision:
        """Take ``num_tokens`` tokens for a request ``reserve`` admitted with none.

        The gateway reserves before tokenizing (1 request + 1 lease: a caller over its
        request rate never costs a tokenizer call) and takes the prompt + output budget
        here once the prompt is counted. A denial is a return value; the caller then
        settles the reservation (the request unit stays spent, the lease goes back).
        ``settle`` gives back whatever this took (remembered by lease id in the store),
        so a take whose answer was lost (timeout, cancel) settles exactly too.

        Raises:
            ValueError: ``num_tokens`` is negative.
            LimiterUnavailableError: the store failed and ``fail_mode`` is closed.
        """
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        start = time.perf_counter()
        policy, source = reservation.policy, reservation.source

        def call(store: Store) -> Awaitable[Outcome]:
            return store.take(
                reservation.tenant_id,
                policy,
                num_tokens=num_tokens,
                lease_id=reservation.lease_id,
                shadow=tenant.shadow_mode,
            )

        try:
            if not policy.tokens_per_minute:
                # no token limit: nothing to check or take (settle charges no bucket
                # either), so no store call; the request unit was taken by reserve
                outcome = _admitted_unchecked()
            elif source == "local":
                outcome = await call(self.fallback)
            else:
                outcome = await self._call("take", lambda: call(self.store))
        except StoreError as exc:
            self._fail_closed(exc, source)
            # fail open: admit; settle charges the exact usage either way (a take that ran
            # is given back there by lease id, one that did not leaves the usage as debt)
            outcome, source = _admitted_unchecked(), "local"
        metrics.DECISION_SECONDS.labels(source).observe(time.perf_counter() - start)
        decision = self._decision(tenant, policy, outcome, reservation.lease_id, num_tokens, source)
        return dataclasses.replace(decision, reservation=reservation if decision.allowed else None)

    async def _finish(
        self,
        res: Reservation,
        refund: int,
        prompt: int,
        completion: int,
        *,
        refund_take: bool = True,
    ) -> None:
        if res.settled:
            return
        res.settled = True
        store = self.fallback if res.source == "local" else self.store
        lease = res.lease_id if res.holds_lease else ""

        def call() -> Awaitable[bool]:
            return store.settle(
                res.tenant_id,
                res.policy,
                lease_id=lease,
                refund_tokens=refund,
                prompt_tokens=prompt,
                completion_tokens=completion,
                refund_take=refund_take,
            )

        try:
            if res.source == "local":
                await call()
            else:
                await self._call("settle", call)
        except StoreError as exc:
            metrics.SETTLE_SKIPPED.inc()
            log.warning(
                "settle skipped; the lease will expire by TTL",
                tenant=res.tenant_id,
                lease_id=res.lease_id,
                error=str(exc),
            )

    async def heartbeat(self, reservation: Reservation) -> bool:
        """Extend the lease; False only when the store says it already expired."""
        if not reservation.holds_lease or reservation.settled:
            return False
        try:
            if reservation.source == "local":
                alive = await self.fallback.heartbeat(reservation.tenant_id, reservation.lease_id)
            else:
                alive = await self._call(
                    "heartbeat",
                    lambda: self.store.heartbeat(reservation.tenant_id, reservation.lease_id),
                )
        except StoreError:
            return True
        if not alive:
            metrics.LEASES_LOST.inc()
            log.warning(
                "lease expired before its heartbeat",
                tenant=reservation.tenant_id,
                lease_id=reservation.lease_id,
            )
        return alive

    @contextlib.asynccontextmanager
    async def keep_alive(self, reservation: Reservation | None) -> AsyncIterator[None]:
        """Heartbeat the reservation's lease every third of its TTL while inside."""
        if reservation is None or not reservation.holds_lease:
            yield
            return
        interval = self.store.lease_ttl_ms / 3000.0

        async def beat() -> None:
            while True:
                await asyncio.sleep(interval)
                await self.heartbeat(reservation)

        task = asyncio.create_task(beat(), name=f"lease-heartbeat-{reservation.lease_id}")
        try:
            yield
        finally:
            await cancel_and_wait(task)

    async def usage(self, tenant: Tenant) -> UsageSnapshot:
        """Live levels and totals from the shared store (raises ``StoreError``)."""
        return await self._call("usage", lambda: self.store.usage(tenant.tenant_id, tenant.limits))

    async def reset(self, tenant_id: str) -> None:
        """Refill the tenant's buckets everywhere (raises ``StoreError``)."""
        await self._call("reset", lambda: self.store.reset(tenant_id))
        await self.fallback.reset(tenant_id)

    async def forget(self, tenant_id: str) -> None:
        """Drop all limiter state of a deleted tenant (raises ``StoreError``)."""
        await self._call("forget", lambda: self.store.forget(tenant_id))
        await self.fallback.forget(tenant_id)

    async def close(self) -> None:
        """Close the stores."""
        await self.store.close()
        await self.fallback.close()
