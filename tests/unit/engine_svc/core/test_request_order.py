"""RequestOrder: urgency, aging, fair share, the isolation floor, the waiting order."""

from __future__ import annotations

from collections.abc import Callable

from engine_svc.core.config import SchedulerConfig
from engine_svc.core.request import Request, RequestStatus
from engine_svc.core.request_order import (
    FairShareOrder,
    PriorityOrder,
    RequestOrder,
    create_request_order,
)
from engine_svc.core.sampling_params import SamplingParams
from tests.support.clock import FakeClock

LOW, NORMAL, CRITICAL = 1, 2, 3


def req(rid: str, t: float = 0.0, priority: int = NORMAL, tenant: str = "", n: int = 4) -> Request:
    return Request.create(rid, [7] * n, SamplingParams(max_tokens=4), t, priority, tenant_id=tenant)


def order(fair_share: bool = True, **cfg: float | bool) -> RequestOrder:
    config = SchedulerConfig(fair_share=fair_share, **cfg)  # type: ignore[arg-type]
    return create_request_order(config)


def drain(pick: Callable[[], Request | None]) -> list[str]:
    """Every pick, each marked admitted (RUNNING) before the next, as the scheduler does."""
    ids = []
    while (r := pick()) is not None:
        r.status = RequestStatus.RUNNING
        ids.append(r.request_id)
    return ids


def test_the_factory_follows_fair_share() -> None:
    assert type(order(fair_share=False)) is PriorityOrder
    assert order(fair_share=False).fair is None
    fair = order(fair_share=True)
    assert type(fair) is FairShareOrder
    assert fair.fair is not None


def test_priority_order_by_class_then_arrival() -> None:
    o = order(fair_share=False)
    waiting = [req("n2", 2.0), req("l0", 0.0, LOW), req("c3", 3.0, CRITICAL), req("n1", 1.0)]
    assert drain(o.waiting_order(waiting, [], 3.0, None)) == ["c3", "n1", "n2", "l0"]
    assert [r.request_id for r in waiting] == ["c3", "n1", "n2", "l0"]  # sorted in place


def test_aging_raises_a_waiting_request_one_class_per_period() -> None:
    clock = FakeClock()
    o = order(fair_share=False, priority_aging_seconds=10.0)
    low = req("low", clock(), LOW)
    clock.advance(5.0)
    assert o.aged(low, clock()) == 1.5
    assert o.klass(low, clock()) == LOW
    crit = req("crit", clock(), CRITICAL)
    assert [r.request_id for r in sorted([low, crit], key=lambda r: o.urgency(r, clock()))] == [
        "crit",
        "low",
    ]
    assert o.outranks_by_class(crit, low, clock())
    clock.advance(20.0)  # 2.5 periods: LOW (3.5) ranks above a fresh CRITICAL (3.0)
    assert o.klass(low, clock()) == CRITICAL
    fresh = req("fresh", clock(), CRITICAL)
    assert not o.outranks_by_class(fresh, low, clock())
    assert drain(o.waiting_order([fresh, crit, low], [], clock(), None)) == ["crit", "low", "fresh"]
    assert o.aged(req("future", clock() + 5.0), clock()) == NORMAL  # aging never lowers


def test_fair_share_orders_a_class_by_tenant_counter_then_arrival() -> None:
    o = order()
    waiting = [req("a1", 0.0, tenant="a"), req("a2", 1.0, tenant="a"), req("b1", 2.0, tenant="b")]
    for r in waiting:
        o.queued(r, 0.0)
    o.charge(waiting[0], 10)  # a served 10 prefill tokens
    assert drain(o.waiting_order(waiting, [], 0.0, None)) == ["b1", "a1", "a2"]
    crit = req("c", 3.0, CRITICAL, tenant="a")
    o.queued(crit, 3.0)
    waiting = [req("b2", 0.0, tenant="b"), crit]
    assert drain(o.waiting_order(waiting, [], 3.0, None)) == ["c", "b2"]  # class before share


def test_fair_waiting_order_re_chooses_after_each_charge() -> None:
    o = order()
    waiting = [req(f"{t}{i}", float(i), tenant=t) for t in "ab" for i in range(2)]
    for r in waiting:
        o.queued(r, 0.0)
    pick = o.waiting_order(waiting, [], 0.0, None)
    picked = []
    while (head := pick()) is not None:
        head.status = RequestStatus.RUNNING
        o.charge(head, 4)
        picked.append(head.request_id)
    assert picked == ["a0", "b0", "a1", "b1"]


def test_a_level_tenant_with_nothing_running_goes_first() -> None:
    o = order()
    running, waiting = (
        [req("a0", 0.0, tenant="a")],
        [req("a1", 1.0, tenant="a"), req("b0", 2.0, tenant="b")],
    )
    for r in running + waiting:
        o.queued(r, 0.0)
    assert drain(o.waiting_order(waiting, running, 2.0, None)) == ["b0", "a1"]


def test_isolation_floor() -> None:
    o = order(priority_isolation=True, priority_aging_seconds=10.0)
    low, crit = req("low", 0.0, LOW), req("crit", 0.0, CRITICAL)
    assert o.isolation_floor([low, crit], [], 0.0) == CRITICAL
    assert o.isolation_floor([crit], [], 0.0) is None  # nothing lower to hold back
    assert o.isolation_floor([crit], [low], 0.0) == CRITICAL
    assert o.isolation_floor([low], [crit], 0.0) is None
    assert o.eligible(CRITICAL, [low, crit], 0.0) == [crit]
    assert drain(o.waiting_order([low, req("c2", 0.0, CRITICAL)], [], 0.0, CRITICAL)) == ["c2"]
    # low aged past CRITICAL: a fresh CRITICAL does not hold it back
    assert o.isolation_floor([req("c3", 25.0, CRITICAL)], [req("l2", 0.0, LOW)], 25.0) is None
    assert order(priority_isolation=False).isolation_floor([low, crit], [], 0.0) is None


def test_recent_top_class_within_the_window() -> None:
    clock = FakeClock()
    o = order(priority_window_s=5.0)
    o.queued(req("n", 0.0), clock())
    assert o.recent_top_class(clock()) == NORMAL
    clock.advance(1.0)
    o.queued(req("c", clock(), CRITICAL), clock())
    assert o.recent_top_class(clock()) == CRITICAL
    clock.advance(5.5)  # NORMAL and CRITICAL both out of the window
    assert o.recent_top_class(clock()) == 0
    assert order(priority_window_s=0.0).recent_top_class(0.0) == 0


def test_prefill_cap_only_while_two_tenants_wait_for_prefill() -> None:
    o = order(fair_prefill_chunk=8)
    a, b = req("a", tenant="a", n=20), req("b", tenant="b", n=20)
    assert o.prefill_cap([a], []) == 0
    assert o.prefill_cap([a], [b]) == 8
    b.num_computed_tokens = 20  # b decodes: no longer a prompt
    assert o.prefill_cap([a], [b]) == 0
    assert order(fair_prefill_chunk=0).prefill_cap([a], [req("c", tenant="c")]) == 0
    assert (
        order(fair_share=False, fair_prefill_chunk=8).prefill_cap([a, req("x", tenant="x")], [])
        == 0
    )


def test_ahead_only_under_fair_share() -> None:
    a, b = req("a", 0.0, tenant="a"), req("b", 1.0, tenant="b")
    assert not order(fair_share=False).ahead(b, a, 1.0)
    o = order()
    for r in (a, b):
        o.queued(r, 0.0)
    assert o.ahead(b, a, 1.0)  # level counters, another tenant
    assert not o.ahead(req("a2", 2.0, tenant="a"), a, 2.0)  # the same tenant: by arrival
    o.charge(b, 5)
    assert not o.ahead(b, a, 1.0)


def test_outranks_in_flight() -> None:
    o = order()
    in_flight = [req("a", 0.0, tenant="a")]
    for r in (*in_flight, req("b", tenant="b")):
        o.queued(r, 0.0)
    o.charge(in_flight[0], 10)
    crit, level = req("c", 1.0, CRITICAL, tenant="a"), req("b", 1.0, tenant="b")
    assert o.outranks_in_flight(in_flight, False, 1.0)(crit)
    assert not o.outranks_in_flight(in_flight, False, 1.0)(level)
    assert o.outranks_in_flight(in_flight, True, 1.0)(level)
    assert not o.outranks_in_flight(in_flight, True, 1.0)(req("a2", 1.0, tenant="a"))
