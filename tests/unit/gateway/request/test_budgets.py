"""Tenant budgets on the request path (a ledger in memory standing for the Redis one):
a tenant without budgets costs nothing, a refusal names the budget, the fail modes."""

from __future__ import annotations

import grpc
import pytest

from gateway.domain import CallContext, GatewayError
from gateway.request.budgets import WARNING_HEADER, BudgetGate
from ratelimit.budget.policy import Budget, Metric, Period, PriceTable
from ratelimit.config import Tenant
from tests.support.clock import FakeClock
from tests.unit.gateway.request.fakes import FakeLedger

DAILY = Budget("daily", Metric.TOKENS, Period.DAY, 1000, warn_percent=50)
TENANT = Tenant("acme", budgets=(DAILY,))


def gate(fail_mode: str = "open") -> tuple[BudgetGate, FakeLedger]:
    ledger = FakeLedger(FakeClock(1_700_000_000.0))
    return BudgetGate(ledger, PriceTable(), fail_mode), ledger  # type: ignore[arg-type]


async def test_a_tenant_without_budgets_costs_no_ledger_call() -> None:
    budgets, ledger = gate()
    ledger.down = True  # any call would raise
    assert await budgets.charge(Tenant("free"), "m", 10, 100, CallContext()) is None


async def test_a_charge_holds_prompt_and_max_tokens_and_settle_charges_the_usage() -> None:
    budgets, ledger = gate()
    hold = await budgets.charge(TENANT, "m", 100, 200, CallContext())
    assert hold is not None
    assert ledger.used[("acme", "daily")] == 300
    await budgets.settle(hold, 100, 20)
    assert ledger.used[("acme", "daily")] == 120
    await budgets.settle(hold, 100, 20)  # twice: a no-op
    assert ledger.used[("acme", "daily")] == 120


async def test_past_its_soft_threshold_a_request_is_warned_in_a_header() -> None:
    budgets, _ = gate()
    call = CallContext()
    await budgets.charge(TENANT, "m", 100, 300, call)
    assert WARNING_HEADER not in call.ratelimit
    await budgets.charge(TENANT, "m", 100, 100, call)  # 600 of 1000: past 50 %
    assert call.ratelimit[WARNING_HEADER].startswith("daily: 60% of")


async def test_over_budget_is_resource_exhausted_naming_the_budget_with_its_wait() -> None:
    budgets, ledger = gate()
    await budgets.charge(TENANT, "m", 500, 400, CallContext())
    with pytest.raises(GatewayError) as info:
        await budgets.charge(TENANT, "m", 100, 100, CallContext())
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "'daily'" in info.value.message
    assert info.value.retry_after_ms == 60_000
    assert any(k.endswith("-bin") for k, _ in info.value.metadata())  # QuotaFailure
    assert ledger.used[("acme", "daily")] == 900  # the refused one held nothing


@pytest.mark.parametrize("fail_mode", ["open", "closed"])
async def test_a_store_failure_fails_open_or_closed(fail_mode: str) -> None:
    budgets, ledger = gate(fail_mode)
    ledger.down = True
    if fail_mode == "open":
        assert await budgets.charge(TENANT, "m", 10, 10, CallContext()) is None
        return
    with pytest.raises(GatewayError) as info:
        await budgets.charge(TENANT, "m", 10, 10, CallContext())
    assert info.value.code == grpc.StatusCode.UNAVAILABLE
    assert "fails closed" in info.value.message


async def test_a_settle_the_store_failed_leaves_the_hold_charged_and_raises_nothing() -> None:
    budgets, ledger = gate()
    hold = await budgets.charge(TENANT, "m", 10, 90, CallContext())
    assert hold is not None
    ledger.down = True
    await budgets.settle(hold, 10, 5)
    assert ledger.used[("acme", "daily")] == 100
