"""Tenant budgets on the request path, over the real ledger (Lua on a real Redis): a
tenant without budgets costs nothing, a refusal names the budget, the fail modes."""

from __future__ import annotations

import grpc
import pytest

from gateway.domain import CallContext, GatewayError
from gateway.request.budgets import WARNING_HEADER, BudgetGate
from ratelimit.budget.ledger import BudgetLedger
from ratelimit.budget.policy import Budget, Metric, Period, PriceTable
from ratelimit.config import Tenant
from tests.support.clock import FakeClock
from tests.unit.gateway.request.fakes import Ledgers, used

DAILY = Budget("daily", Metric.TOKENS, Period.DAY, 1000, warn_percent=50)
TENANT = Tenant("acme", budgets=(DAILY,))


def gate(ledgers: Ledgers, fail_mode: str = "open") -> tuple[BudgetGate, BudgetLedger]:
    ledger = ledgers.up(FakeClock(1_700_000_000.0))
    return BudgetGate(ledger, PriceTable(), fail_mode), ledger


async def test_a_tenant_without_budgets_costs_no_ledger_call(ledgers: Ledgers) -> None:
    budgets = BudgetGate(ledgers.down(), PriceTable(), "closed")  # any call would fail
    assert await budgets.charge(Tenant("free"), "m", 10, 100, CallContext()) is None


async def test_a_charge_holds_prompt_and_max_tokens_and_settle_charges_the_usage(
    ledgers: Ledgers,
) -> None:
    budgets, ledger = gate(ledgers)
    hold = await budgets.charge(TENANT, "m", 100, 200, CallContext())
    assert hold is not None
    assert await used(ledger, "acme", DAILY) == 300
    await budgets.settle(hold, 100, 20)
    assert await used(ledger, "acme", DAILY) == 120
    await budgets.settle(hold, 100, 20)  # twice: a no-op
    assert await used(ledger, "acme", DAILY) == 120


async def test_past_its_soft_threshold_a_request_is_warned_in_a_header(
    ledgers: Ledgers,
) -> None:
    budgets, _ = gate(ledgers)
    call = CallContext()
    await budgets.charge(TENANT, "m", 100, 300, call)
    assert WARNING_HEADER not in call.ratelimit
    await budgets.charge(TENANT, "m", 100, 100, call)  # 600 of 1000: past 50 %
    assert call.ratelimit[WARNING_HEADER].startswith("daily: 60% of")


async def test_over_budget_is_resource_exhausted_naming_the_budget_with_its_wait(
    ledgers: Ledgers,
) -> None:
    budgets, ledger = gate(ledgers)
    await budgets.charge(TENANT, "m", 500, 400, CallContext())
    with pytest.raises(GatewayError) as info:
        await budgets.charge(TENANT, "m", 100, 100, CallContext())
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "'daily'" in info.value.message
    # a calendar day refills at midnight UTC: 1_700_000_000 is 22:13:20
    assert info.value.retry_after_ms == (86_400 - 1_700_000_000 % 86_400) * 1000
    assert any(k.endswith("-bin") for k, _ in info.value.metadata())  # QuotaFailure
    assert await used(ledger, "acme", DAILY) == 900  # the refused one held nothing


@pytest.mark.parametrize("fail_mode", ["open", "closed"])
async def test_a_store_failure_fails_open_or_closed(ledgers: Ledgers, fail_mode: str) -> None:
    budgets = BudgetGate(ledgers.down(), PriceTable(), fail_mode)
    if fail_mode == "open":
        assert await budgets.charge(TENANT, "m", 10, 10, CallContext()) is None
        return
    with pytest.raises(GatewayError) as info:
        await budgets.charge(TENANT, "m", 10, 10, CallContext())
    assert info.value.code == grpc.StatusCode.UNAVAILABLE
    assert "fails closed" in info.value.message


async def test_a_settle_the_store_failed_leaves_the_hold_charged_and_raises_nothing(
    ledgers: Ledgers,
) -> None:
    budgets, ledger = gate(ledgers)
    hold = await budgets.charge(TENANT, "m", 10, 90, CallContext())
    assert hold is not None
    budgets.ledger = ledgers.down()  # Redis went away between the charge and the settle
    await budgets.settle(hold, 10, 5)
    assert await used(ledger, "acme", DAILY) == 100
