"""Per-tenant fair queues in front of a model's engine replicas, for when all are full.

When every replica of a model refuses a request because its queue is full
(RESOURCE_EXHAUSTED before any token), the dispatcher waits here, bounded by
``max_wait_s`` and the request's deadline, instead of refusing at once. While
anyone waits, new requests for that model wait too (no barging past the
queue). Capacity that frees (an attempt of this gateway ends, or ``tick_s``
passes without one, for capacity freed by other gateway replicas) goes to one
waiter at a time, chosen fairly across tenants: the tenant with the least
service so far, counted as turns divided by its share, FIFO within a tenant.
A tenant that starts waiting is lifted to the least-served waiting tenant, so
idle time banks no credit (the same rule as the engines' fair share). A woken
request that is refused again goes back to the front of its tenant's line and
its turn is taken back; a tenant's counter outlives its line for ``keep_s``
after its last turn, so a turn that comes back does not reset it.

Bounds: ``max_waiting`` requests in all and ``max_waiting_per_tenant`` per
tenant; past them, or when the wait runs out, the caller refuses with
RESOURCE_EXHAUSTED and a retry-after. Nothing here holds a lease or tokens:
the request that waits keeps what admission gave it, released on every path
by the pipeline.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from gateway import metrics


@dataclass(slots=True)
class _Waiter:
    tenant: str
    share: float
    future: asyncio.Future[None]
    since: float = field(default_factory=time.perf_counter)


class TenantTurns:
    """Which tenant's waiter goes next: the least served, by turns / share (pure)."""

    def __init__(self) -> None:
        self.served: dict[str, float] = {}
        self.last_turn: dict[str, float] = {}  # tenant -> when it last had one

    def lift(self, tenant: str, waiting: list[str]) -> None:
        """A tenant starts waiting: no less than the least served one already waiting."""
        floor = min((self.served[t] for t in waiting if t in self.served), default=0.0)
        self.served[tenant] = max(self.served.get(tenant, 0.0), floor)

    def pick(self, waiting: list[str]) -> str:
        """The next tenant among ``waiting`` (ties: the order given, i.e. who waited first)."""
        return min(waiting, key=lambda t: self.served.get(t, 0.0))

    def charge(self, tenant: str, share: float, turns: int = 1, now: float = 0.0) -> None:
        """Count ``turns`` (-1: take back one that found no capacity)."""
        self.served[tenant] = self.served.get(tenant, 0.0) + turns / max(share, 1e-6)
        self.last_turn[tenant] = now

    def forget(self, keep: set[str], now: float, keep_s: float) -> None:
        """Drop the counters of tenants not in ``keep`` whose last turn is older than
        ``keep_s``."""
        fresh = {t for t, at in self.last_turn.items() if now - at <= keep_s} | keep
        self.served = {t: v for t, v in self.served.items() if t in fresh}
        self.last_turn = {t: v for t, v in self.last_turn.items() if t in fresh}


class FairQueue:
    """The waiters of one model.

    Args:
        max_wait_s: Longest wait of one request (0 = no queue: refuse at once).
        max_waiting: Requests waiting at most.
        max_waiting_per_tenant: Requests of one tenant waiting at most.
        tick_s: A waiter is woken at least this often while any wait.
        keep_s: How long a tenant's counter outlives its line (after its last turn).
        clock: Monotonic seconds.
    """

    def __init__(
        self,
        max_wait_s: float,
        max_waiting: int = 1024,
        max_waiting_per_tenant: int = 256,
        tick_s: float = 0.1,
        keep_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_wait_s = max_wait_s
        self.max_waiting = max_waiting
        self.max_waiting_per_tenant = max_waiting_per_tenant
        self.tick_s = tick_s
        self.keep_s = keep_s
        self.clock = clock
        self._lines: dict[str, deque[_Waiter]] = {}
        self._turns = TenantTurns()
        self._num_waiting = 0
        self._ticker: asyncio.Task[None] | None = None

    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    async def wait(
        self, tenant: str, share: float, seconds_left: float, *, front: bool = False
    ) -> bool:
        """Wait for this request's turn: True when it may try the engines again, False
        when the queue is full or the wait ran out (the caller refuses).

        Args:
            front: Go first in the tenant's line (a woken request refused again).
        """
        budget = min(self.max_wait_s, seconds_left)
        line = self._lines.get(tenant)
        if (
            budget <= 0
            or self._num_waiting >= self.max_waiting
            or (line is not None and len(line) >= self.max_waiting_per_tenant)
        ):
            metrics.FAIR_QUEUE_REFUSED.inc()
            return False
        if line is None:
            self._turns.lift(tenant, list(self._lines))
            line = self._lines[tenant] = deque()
        if front:  # its turn found no capacity after all: not counted as service
            self._turns.charge(tenant, share, turns=-1, now=self.clock())
        waiter = _Waiter(tenant, share, asyncio.get_running_loop().create_future())
        (line.appendleft if front else line.append)(waiter)
        self._num_waiting += 1
        metrics.FAIR_QUEUE_WAITING.inc()
        self._start_ticker()
        try:
            await asyncio.wait_for(asyncio.shield(waiter.future), budget)
        except TimeoutError:
            metrics.FAIR_QUEUE_TIMEOUTS.inc()
            return False
        finally:
            if not waiter.future.done():  # timed out or cancelled: leave the line
                waiter.future.cancel()
                self._remove(waiter)
            metrics.FAIR_QUEUE_WAIT.observe(time.perf_counter() - waiter.since)
        return True

    def release(self) -> None:
        """Capacity freed (an attempt ended): the next waiter, in fair order, may go."""
        if not self._lines:
            self._turns.forget(set(), self.clock(), self.keep_s)
            return
        tenant = self._turns.pick(list(self._lines))
        waiter = self._lines[tenant][0]
        self._turns.charge(tenant, waiter.share, now=self.clock())
        self._remove(waiter)
        waiter.future.set_result(None)

    def _remove(self, waiter: _Waiter) -> None:
        line = self._lines.get(waiter.tenant)
        if line is None or waiter not in line:
            return
        line.remove(waiter)
        self._num_waiting -= 1
        metrics.FAIR_QUEUE_WAITING.dec()
        if not line:
            del self._lines[waiter.tenant]
            self._turns.forget(set(self._lines), self.clock(), self.keep_s)

    def _start_ticker(self) -> None:
        if self._ticker is None or self._ticker.done():
            self._ticker = asyncio.ensure_future(self._tick())

    async def _tick(self) -> None:
        # capacity freed elsewhere (another gateway's requests) shows only by trying
        while self._lines:
            await asyncio.sleep(self.tick_s)
            self.release()


class FairQueues:
    """One FairQueue per model, made on first use."""

    def __init__(self, max_wait_s: float, max_waiting: int, max_waiting_per_tenant: int) -> None:
        self.max_wait_s = max_wait_s
        self.max_waiting = max_waiting
        self.max_waiting_per_tenant = max_waiting_per_tenant
        self._by_model: dict[str, FairQueue] = {}

    @property
    def enabled(self) -> bool:
        return self.max_wait_s > 0

    def of(self, model: str) -> FairQueue:
        q = self._by_model.get(model)
        if q is None:
            q = self._by_model[model] = FairQueue(
                self.max_wait_s, self.max_waiting, self.max_waiting_per_tenant
            )
        return q

    def release(self, model: str) -> None:
        q = self._by_model.get(model)
        if q is not None:
            q.release()
