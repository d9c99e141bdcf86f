"""The gateway's per-tenant fair queues: who goes next when capacity frees, the bounds,
and that nothing stays queued (property-based over arrivals, releases and timeouts)."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.fleet.fair_queue import FairQueue, TenantTurns


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_flood_does_not_delay_another_tenant_past_one_turn() -> None:
    q = FairQueue(max_wait_s=10, tick_s=60)
    order: list[str] = []

    async def one(tenant: str, i: int) -> None:
        assert await q.wait(tenant, 1.0, 10)
        order.append(f"{tenant}{i}")

    flood = [asyncio.ensure_future(one("flood", i)) for i in range(6)]
    await settle()
    q.release()  # flood0 goes: the flood has had a turn
    await settle()
    chat = [asyncio.ensure_future(one("chat", i)) for i in range(2)]
    await settle()
    for _ in range(7):
        q.release()
        await settle()
    await asyncio.gather(*flood, *chat)
    # the chat tenant, arriving behind five flood requests, is served at every other
    # turn (lifted level with the flood, never ahead by banked idle time)
    assert order[:5] == ["flood0", "flood1", "chat0", "flood2", "chat1"]
    assert q.num_waiting == 0


async def test_shares_weight_the_turns() -> None:
    q = FairQueue(max_wait_s=10, tick_s=60)
    order: list[str] = []

    async def one(tenant: str, share: float) -> None:
        assert await q.wait(tenant, share, 10)
        order.append(tenant)

    tasks = [asyncio.ensure_future(one("gold", 2.0)) for _ in range(8)]
    tasks += [asyncio.ensure_future(one("free", 1.0)) for _ in range(8)]
    await settle()
    for _ in range(9):
        q.release()
        await settle()
    assert order.count("gold") == 6  # 2:1 over the first nine turns
    assert order.count("free") == 3
    for _ in range(7):
        q.release()
        await settle()
    await asyncio.gather(*tasks)


async def test_bounds_refuse_at_once_and_the_wait_runs_out() -> None:
    q = FairQueue(max_wait_s=0.05, max_waiting=3, max_waiting_per_tenant=2, tick_s=60)
    waits = [asyncio.ensure_future(q.wait("a", 1.0, 10)) for _ in range(2)]
    await settle()
    assert not await q.wait("a", 1.0, 10)  # the tenant's line is full
    waits.append(asyncio.ensure_future(q.wait("b", 1.0, 10)))
    await settle()
    assert not await q.wait("c", 1.0, 10)  # the queue is full
    assert not await q.wait("d", 1.0, 0)  # no time left on the request
    assert await asyncio.gather(*waits) == [False, False, False]  # 50 ms passed: refused
    assert q.num_waiting == 0


async def test_a_turn_that_finds_no_capacity_goes_back_to_the_front_and_is_not_counted() -> None:
    q = FairQueue(max_wait_s=10, tick_s=60)
    first = asyncio.ensure_future(q.wait("a", 1.0, 10))
    second = asyncio.ensure_future(q.wait("a", 1.0, 10))
    other = asyncio.ensure_future(q.wait("b", 1.0, 10))
    await settle()
    q.release()
    assert await first
    again = asyncio.ensure_future(q.wait("a", 1.0, 10, front=True))  # refused again
    await settle()
    q.release()  # "a" was not charged for the wasted turn: tie with "b", "a" is first
    await settle()
    assert again.done()
    assert not second.done()
    for _ in range(2):
        q.release()
        await settle()
    assert await second
    assert await other


async def test_the_ticker_wakes_waiters_without_releases() -> None:
    q = FairQueue(max_wait_s=5, tick_s=0.01)
    assert await asyncio.wait_for(q.wait("a", 1.0, 5), 2)  # capacity freed elsewhere
    assert q.num_waiting == 0


async def test_a_cancelled_waiter_leaves_the_line() -> None:
    q = FairQueue(max_wait_s=10, tick_s=60)
    w = asyncio.ensure_future(q.wait("a", 1.0, 10))
    await settle()
    w.cancel()
    with pytest.raises(asyncio.CancelledError):
        await w
    assert q.num_waiting == 0
    q.release()  # nobody to wake: no error


async def test_a_refused_turn_keeps_its_tenants_place_among_ticks() -> None:
    """The tenant served least keeps that standing when its woken request is refused and
    comes back (its line was empty meanwhile): the flood does not win the next turn."""
    q = FairQueue(max_wait_s=10, tick_s=60)
    flood = [asyncio.ensure_future(q.wait("flood", 1.0, 10)) for _ in range(4)]
    await settle()
    q.release()  # flood served once
    await settle()
    chat = asyncio.ensure_future(q.wait("chat", 1.0, 10))  # lifted level with the flood
    await settle()
    q.release()  # a flood turn (tie: the flood waited first); flood 2, chat 1
    await settle()
    q.release()  # chat's turn (least served), as a tick would give it ...
    await settle()
    assert await chat
    again = asyncio.ensure_future(q.wait("chat", 1.0, 10, front=True))  # ... refused
    await settle()
    q.release()  # the real capacity: chat is still the least served
    await settle()
    assert again.done()
    for _ in range(4):
        q.release()
        await settle()
    await asyncio.gather(*flood)


def test_lift_starts_a_new_tenant_level_with_the_least_served() -> None:
    turns = TenantTurns()
    for _ in range(5):
        turns.charge("flood", 1.0)
    turns.lift("chat", ["flood"])
    assert turns.served["chat"] == turns.served["flood"] == 5
    assert turns.pick(["flood", "chat"]) == "flood"  # ties: who waited first
    turns.charge("flood", 1.0)
    assert turns.pick(["flood", "chat"]) == "chat"


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["arrive", "release", "cancel"]), st.sampled_from("abc")),
        max_size=40,
    )
)
def test_nothing_stays_queued(ops: list[tuple[str, str]]) -> None:
    async def main() -> None:
        now = [0.0]
        q = FairQueue(
            max_wait_s=0.2,
            max_waiting=8,
            max_waiting_per_tenant=4,
            tick_s=60,
            keep_s=5.0,
            clock=lambda: now[0],
        )
        tasks: list[asyncio.Future[bool]] = []
        for op, tenant in ops:
            if op == "arrive":
                tasks.append(asyncio.ensure_future(q.wait(tenant, 1.0, 1.0)))
            elif op == "release":
                q.release()
            elif tasks:
                tasks[len(tasks) // 2].cancel()
            await settle()
            assert q.num_waiting == sum(len(line) for line in q._lines.values())
            assert q.num_waiting <= 8
        await asyncio.gather(*tasks, return_exceptions=True)
        assert q.num_waiting == 0
        assert not q._lines
        now[0] += 6.0  # past keep_s since the last turn: no counter is kept
        q.release()
        assert not q._turns.served
        assert not q._turns.last_turn

    asyncio.run(main())
