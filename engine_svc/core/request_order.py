"""The order the scheduler serves requests in: urgency, aging, class, isolation.

A request's priority class rises by one for every ``priority_aging_seconds`` it
has waited or run (aging never lowers it), so nothing starves: a LOW request
that has waited long enough ranks like a higher class.

Two orders, picked by ``create_request_order`` from ``SchedulerConfig.fair_share``:

- ``PriorityOrder``: the aged priority itself, then arrival;
- ``FairShareOrder``: the aged class (whole classes), then the tenant's
  fair-share counter (``FairShare``: the service each tenant has received,
  weighted), then arrival. The tenant served least goes first, so one tenant's
  flood of long prompts queues behind itself, not in front of everyone else.
  While prompts of two or more tenants wait for prefill, each prefill chunk is
  capped at ``fair_prefill_chunk`` tokens (``prefill_cap``), so that every
  tenant's prompt advances each step.

Optionally (``priority_isolation``), a step that admits a request of a higher
class than every running request runs that class alone (``isolation_floor``):
the lower classes wait one step. With ``priority_window_s`` > 0, for that long
after a request of some class arrives, lower classes' prefill chunks are capped
(``recent_top_class``).

The scheduler holds one order, tells it of every queued and finished request
and every scheduled token (``queued``, ``released``, ``charge``), and asks it
which request comes first; it keeps the queues, the budgets and the blocks.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Callable, Iterable, Sequence

from engine_svc.core.config import SchedulerConfig
from engine_svc.core.fair_share import FairShare
from engine_svc.core.request import Request, RequestStatus

Urgency = tuple[float, float, float]
"""A sort key, most urgent first: (negated class or aged priority, fair-share counter, arrival)."""


class RequestOrder:
    """What both orders share: aging, classes, the isolation floor, the arrival window.

    Args:
        config: the scheduler's limits (read at each use, as the scheduler reads them).
    """

    fair: FairShare | None = None

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self._class_seen: dict[int, float] = {}  # base priority -> last arrival (clock)

    def queued(self, req: Request, now: float) -> None:
        """``req`` joined the waiting queue at ``now``."""
        self._class_seen[req.priority] = now

    def released(self, req: Request) -> None:
        """``req`` finished (or was dropped)."""

    def charge(self, req: Request, num_new: int, sign: int = 1) -> None:
        """``req`` was scheduled ``num_new`` tokens (``sign`` -1: that was undone)."""

    def aged(self, req: Request, now: float) -> float:
        """The priority of ``req`` raised by one per ``priority_aging_seconds`` waited."""
        waited = max(0.0, now - req.arrival_time)  # aging never lowers a class
        return req.priority + waited / self.config.priority_aging_seconds

    def klass(self, req: Request, now: float) -> int:
        """The whole class ``req`` ranks in (aged)."""
        return math.floor(self.aged(req, now))

    def outranks_by_class(self, req: Request, other: Request, now: float) -> bool:
        """True when ``req`` ranks a whole class (aged) above ``other``."""
        return self.aged(req, now) - self.aged(other, now) >= 1.0

    def urgency(self, req: Request, now: float) -> Urgency:
        """Sort key, most urgent first: the aged priority, then arrival."""
        return (-self.aged(req, now), 0.0, req.arrival_time)

    def prefill_cap(self, waiting: Iterable[Request], running: Iterable[Request]) -> int:
        """This step's cap on one request's prefill chunk (0 = none)."""
        return 0

    def recent_top_class(self, now: float) -> int:
        """The highest base class with an arrival in the last ``priority_window_s``;
        lower classes' prefill chunks are capped this step (0 = none recent)."""
        window = self.config.priority_window_s
        if window <= 0:
            return 0
        recent = [c for c, t in self._class_seen.items() if now - t <= window]
        return max(recent, default=0)

    def isolation_floor(
        self, waiting: Sequence[Request], running: Sequence[Request], now: float
    ) -> int | None:
        """The class (aged) to run alone this step: that of the most urgent waiting
        request when it is above every running request's, else None. Aging counts,
        so a request that has waited long enough is never held back by a newer
        urgent one."""
        if not self.config.priority_isolation or not waiting:
            return None
        classes = [self.klass(r, now) for r in waiting]
        top = max(classes)
        if running:
            if top <= max(self.klass(r, now) for r in running):
                return None
        elif min(classes) == top:
            return None  # nothing of a lower class to hold back
        return top

    def eligible(self, floor: int | None, reqs: list[Request], now: float) -> list[Request]:
        """``reqs`` without those this step holds back (their class is below ``floor``)."""
        if floor is None:
            return reqs
        return [r for r in reqs if self.klass(r, now) >= floor]

    def waiting_order(
        self,
        waiting: list[Request],
        running: Sequence[Request],
        now: float,
        floor: int | None,
    ) -> Callable[[], Request | None]:
        """The next waiting request to admit, re-chosen after every admission (one
        admitted since the last call is skipped). Sorts ``waiting`` in place, most
        urgent first; leaves out the classes below ``floor``."""
        waiting.sort(key=lambda r: self.urgency(r, now))
        return self._picker(self.eligible(floor, waiting, now), running, now)

    def _picker(
        self, eligible: list[Request], running: Sequence[Request], now: float
    ) -> Callable[[], Request | None]:
        """The first of ``eligible`` not yet admitted."""
        return lambda: next((r for r in eligible if r.status != RequestStatus.RUNNING), None)

    def ahead(self, waiting: Request, prefilling: Request, now: float) -> bool:
        """True when ``waiting`` takes budget before the running prefill ``prefilling``:
        by arrival, running prefills always go first."""
        return False

    def outranks_in_flight(
        self, prompts: Sequence[Request], by_share: bool, now: float
    ) -> Callable[[Request], bool]:
        """Whether a waiting request outranks every one of ``prompts`` (a step in
        flight): of a higher class, or, with ``by_share``, level with their most
        urgent class, of a tenant with no prompt in it, and served no more than the
        least of theirs."""
        keys = [self.urgency(r, now) for r in prompts]
        top = min(k[0] for k in keys)  # the most urgent class in flight (negated)
        tenants = {r.tenant_id for r in prompts}
        least = min(k[1] for k in keys if k[0] == top)

        def outranks(req: Request) -> bool:
            klass, counter, _ = self.urgency(req, now)
            return klass < top or (
                by_share and klass == top and counter <= least and req.tenant_id not in tenants
            )

        return outranks


class PriorityOrder(RequestOrder):
    """By aged priority, then arrival (``fair_share`` off)."""


class FairShareOrder(RequestOrder):
    """By aged class, then the tenant's fair-share counter, then arrival."""

    fair: FairShare

    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config)
        self.fair = FairShare()

    def queued(self, req: Request, now: float) -> None:
        """``req`` joined the waiting queue: its tenant is active."""
        super().queued(req, now)
        self.fair.admit(req.tenant_id)

    def released(self, req: Request) -> None:
        """``req`` finished: its tenant's counter goes once it has no live request."""
        self.fair.release(req.tenant_id)

    def charge(self, req: Request, num_new: int, sign: int = 1) -> None:
        """Charge ``req``'s tenant: prefill or decode tokens, by its weight."""
        decode = req.num_tokens - req.num_computed_tokens <= 1 + len(req.spec_token_ids)
        self.fair.charge(
            req.tenant_id,
            0 if decode else sign * num_new,
            sign * num_new if decode else 0,
            req.tenant_weight,
        )

    def urgency(self, req: Request, now: float) -> Urgency:
        """Sort key, most urgent first: class (aged), then fair share, then arrival."""
        counter = self.fair.counter(req.tenant_id)
        return (-math.floor(self.aged(req, now)), counter, req.arrival_time)

    def prefill_cap(self, waiting: Iterable[Request], running: Iterable[Request]) -> int:
        """``fair_prefill_chunk`` while prompts of two or more tenants wait for
        prefill (running or waiting), else none: a tenant alone, or one whose prompt
        nobody else waits beside, keeps the whole budget."""
        if self.config.fair_prefill_chunk <= 0:
            return 0
        prompts = itertools.chain(
            waiting, (r for r in running if r.num_tokens - r.num_computed_tokens > 1)
        )
        first = next(prompts, None)
        # stops at the second tenant: this runs every step, over every waiting request
        if first is not None and any(r.tenant_id != first.tenant_id for r in prompts):
            return self.config.fair_prefill_chunk
        return 0

    def _picker(
        self, eligible: list[Request], running: Sequence[Request], now: float
    ) -> Callable[[], Request | None]:
        """Each tenant's waiting requests in their own order, the most urgent tenant
        head first (admitting a request charges its tenant, which may change who
        that is)."""
        per_tenant: dict[str, deque[Request]] = {}
        for r in eligible:
            per_tenant.setdefault(r.tenant_id, deque()).append(r)
        live = {r.tenant_id for r in running}

        def key(r: Request) -> tuple[float, float, bool, float]:
            # level tenants: the one with nothing running yet (just lifted) goes first
            klass, counter, arrival = self.urgency(r, now)
            return (klass, counter, r.tenant_id in live, arrival)

        def pick() -> Request | None:
            while per_tenant:
                head = min((q[0] for q in per_tenant.values()), key=key)
                if head.status != RequestStatus.RUNNING:
                    return head
                queue = per_tenant[head.tenant_id]
                queue.popleft()  # admitted since the last pick
                if not queue:
                    del per_tenant[head.tenant_id]
            return None

        return pick

    def ahead(self, waiting: Request, prefilling: Request, now: float) -> bool:
        """True when more urgent, or level with another tenant's (a tenant that just
        became active is lifted level with the least served: it goes first on that tie)."""
        w, p = self.urgency(waiting, now), self.urgency(prefilling, now)
        return w < p or (w[:2] == p[:2] and waiting.tenant_id != prefilling.tenant_id)


def create_request_order(config: SchedulerConfig) -> RequestOrder:
    """The order ``config`` asks for: fair share between tenants, or by priority alone."""
    return FairShareOrder(config) if config.fair_share else PriorityOrder(config)
