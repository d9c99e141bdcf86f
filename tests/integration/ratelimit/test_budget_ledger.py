"""Budgets on a real Redis: reserve -> settle, exhaustion and reset at the boundary
(injected clock), exactness under concurrent gateways, nothing left open."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis.asyncio import Redis

from common.redis_server import RedisServer
from ratelimit.budget.ledger import BudgetLedger
from ratelimit.budget.policy import Budget, Metric, Period, Price
from ratelimit.store_guard import StoreGuard
from tests.support.clock import FakeClock

FREE = Price()


def ledger(client: Redis, prefix: str, clock: FakeClock) -> BudgetLedger:
    return BudgetLedger(client, StoreGuard(2000), prefix=prefix, clock=clock)


async def open_holds(client: Redis, prefix: str, tenant: str) -> int:
    return int(await client.hlen(f"{prefix}{{{tenant}}}:Bh"))


async def test_calendar_day_budget_refuses_then_resets_at_midnight(
    redis_client: Redis, prefix: str
) -> None:
    clock = FakeClock(datetime(2026, 12, 1, 22, 0, tzinfo=UTC).timestamp())  # 23:00 in Berlin
    led = ledger(redis_client, prefix, clock)
    day = Budget("daily", Metric.TOKENS, Period.DAY, 1000, timezone="Europe/Berlin")
    first = await led.charge("t1", [day], FREE, prompt_tokens=100, max_tokens=700)
    assert first.allowed
    assert first.hold is not None
    # used 100 + 50 of the 800 reserved: 650 go back
    assert await led.settle(first.hold, prompt_tokens=100, completion_tokens=50)
    assert not await led.settle(first.hold, prompt_tokens=100, completion_tokens=50)
    (level,) = await led.levels("t1", [day])
    assert level.used == 150
    second = await led.charge("t1", [day], FREE, prompt_tokens=100, max_tokens=800)
    assert not second.allowed
    assert second.refused is not None
    assert second.refused.used == 150
    # midnight in Berlin is 23:00 UTC: one hour away
    assert second.retry_after_ms == 3_600_000
    msg = second.message("t1")
    assert "'daily'" in msg
    assert "150 tokens used" in msg
    assert "2026-12-01T23:00:00Z" in msg
    clock.advance(3600)  # exactly the period's end
    third = await led.charge("t1", [day], FREE, prompt_tokens=100, max_tokens=800)
    assert third.allowed
    assert third.levels[0].used == 0
    too_big = await led.charge("t1", [day], FREE, prompt_tokens=500, max_tokens=600)
    assert not too_big.allowed
    assert too_big.retry_after_ms == -1
    assert "never fit" in too_big.message("t1")


async def test_rolling_hour_frees_room_as_old_slots_age_out(
    redis_client: Redis, prefix: str
) -> None:
    t0 = 1_800_000_000.0  # on a minute boundary
    clock = FakeClock(t0)
    led = ledger(redis_client, prefix, clock)
    hour = Budget("hourly", Metric.TOKENS, Period.HOUR, 100, rolling=True)
    a = await led.charge("t", [hour], FREE, prompt_tokens=60, max_tokens=0)
    assert a.allowed
    clock.now = t0 + 30 * 60
    b = await led.charge("t", [hour], FREE, prompt_tokens=40, max_tokens=0)
    assert b.allowed
    clock.now = t0 + 59 * 60
    c = await led.charge("t", [hour], FREE, prompt_tokens=50, max_tokens=0)
    assert not c.allowed
    # the first charge stops counting 61 minutes after its slot began
    assert c.retry_after_ms == 2 * 60_000
    clock.now = t0 + 61 * 60
    d = await led.charge("t", [hour], FREE, prompt_tokens=50, max_tokens=0)
    assert d.allowed
    assert d.levels[0].used == 40


async def test_cost_budget_and_every_budget_all_or_nothing(
    redis_client: Redis, prefix: str
) -> None:
    led = ledger(redis_client, prefix, FakeClock(1_800_000_000.0))
    price = Price(prompt_per_million=1.0, completion_per_million=2.0)
    usd = Budget("usd", Metric.COST, Period.MONTH, 0.001)  # 1000 prompt tokens' worth
    tok = Budget("tok", Metric.TOKENS, Period.DAY, 10_000)
    ok = await led.charge("t", [tok, usd], price, prompt_tokens=200, max_tokens=100)
    assert ok.allowed
    assert ok.amounts[0] == 300.0
    assert ok.amounts[1] == pytest.approx(0.0004)
    no = await led.charge("t", [tok, usd], price, prompt_tokens=200, max_tokens=250)
    assert not no.allowed
    assert no.refused is not None
    assert no.refused.budget is usd
    # the refused call charged neither budget
    levels = await led.levels("t", [tok, usd])
    assert [lv.used for lv in levels] == [300.0, pytest.approx(0.0004)]
    assert ok.hold is not None
    await led.settle(ok.hold, prompt_tokens=200, completion_tokens=10)
    levels = await led.levels("t", [tok, usd])
    assert [lv.used for lv in levels] == [210.0, pytest.approx(0.00022)]


async def test_shadow_mode_charges_and_admits_over_budget(redis_client: Redis, prefix: str) -> None:
    led = ledger(redis_client, prefix, FakeClock(1_800_000_000.0))
    b = Budget("d", Metric.TOKENS, Period.DAY, 10)
    d = await led.charge("t", [b], FREE, prompt_tokens=20, max_tokens=0, shadow=True)
    assert d.allowed
    assert d.refused is not None
    assert d.hold is not None
    assert (await led.levels("t", [b]))[0].used == 20


async def test_concurrent_gateways_never_overspend(redis_server: RedisServer, prefix: str) -> None:
    """Four clients (as four gateway replicas) race for one budget: exactly the limit is
    admitted, and after every hold settles the used total equals the admitted usage."""
    clients = [Redis.from_url(redis_server.url, decode_responses=True) for _ in range(4)]
    try:
        clock = FakeClock(1_800_000_000.0)
        ledgers = [ledger(c, prefix, clock) for c in clients]
        b = Budget("d", Metric.TOKENS, Period.DAY, 1000)

        async def one(i: int) -> bool:
            d = await ledgers[i % 4].charge("t", [b], FREE, prompt_tokens=7, max_tokens=3)
            if d.hold is not None:
                await ledgers[(i + 1) % 4].settle(d.hold, prompt_tokens=7, completion_tokens=3)
            return d.allowed

        results = await asyncio.gather(*(one(i) for i in range(160)))
        assert sum(results) == 100
        assert (await ledgers[0].levels("t", [b]))[0].used == 1000
        assert await open_holds(clients[0], prefix, "t") == 0
    finally:
        for c in clients:
            await c.aclose()


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    requests=st.lists(
        st.tuples(st.integers(0, 50), st.integers(0, 50), st.integers(0, 50)),
        min_size=1,
        max_size=12,
    )
)
async def test_settled_usage_is_exact_and_no_hold_stays_open(
    redis_client: Redis, prefix: str, requests: list[tuple[int, int, int]]
) -> None:
    """Whatever mix of admitted and refused requests: after settling every hold the
    budget holds exactly the tokens used, and no hold is left open."""
    tenant = f"h{abs(hash(tuple(requests))) % 10**9}"
    led = ledger(redis_client, prefix, FakeClock(1_800_000_000.0))
    b = Budget("d", Metric.TOKENS, Period.DAY, 300)
    used = 0
    for prompt, max_new, produced in requests:
        d = await led.charge(tenant, [b], FREE, prompt_tokens=prompt, max_tokens=max_new)
        if d.hold is not None:
            out = min(produced, max_new)
            await led.settle(d.hold, prompt_tokens=prompt, completion_tokens=out)
            used += prompt + out
    assert (await led.levels(tenant, [b]))[0].used == used
    assert await open_holds(redis_client, prefix, tenant) == 0
    await led.forget(tenant, [b])
