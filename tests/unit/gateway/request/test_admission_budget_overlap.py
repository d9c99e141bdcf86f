"""A request a budget applies to never overlaps the engine's start (real limiter over
the in-memory store, real budget ledger on a real Redis): its budget answers inside
``finish``, before the pipeline makes any engine call, so a refusal costs no engine
work; a tenant without budgets still overlaps."""

from __future__ import annotations

import grpc
import pytest

from gateway.domain import CallContext, GatewayError
from gateway.fleet.dispatcher import AttemptProgress
from gateway.request.admission import Admission
from gateway.request.budgets import BudgetGate
from ratelimit.budget.policy import Budget, Metric, Period, PriceTable
from ratelimit.config import Tenant
from tests.support.clock import FakeClock
from tests.unit.gateway.request.fakes import TENANT, Ledgers, engine_job, limiter

JOB = engine_job(num_prompt=10, max_tokens=100)  # 110 tokens
SMALL = engine_job(num_prompt=10, max_tokens=0)  # 10 tokens


async def admitted(adm: Admission, tenant: Tenant) -> None:
    """One whole small request (so the limiter has seen the tenant's headroom)."""
    ticket = await adm.start(tenant, CallContext())
    await adm.finish(ticket, SMALL, 0, CallContext())
    await adm.confirm(ticket)
    await adm.settle(ticket, None, AttemptProgress(), False, None)


async def test_a_budget_refuses_inside_finish_before_any_engine_call(ledgers: Ledgers) -> None:
    gate = BudgetGate(ledgers.up(FakeClock(1_700_000_000.0)), PriceTable(), "open")
    adm = Admission(limiter(), gate)  # overlap on, as by default
    hourly = Budget("hourly", Metric.TOKENS, Period.HOUR, 50, warn_percent=0)
    tenant = Tenant("acme", TENANT.limits, budgets=(hourly,))
    for _ in range(2):  # small ones fit; the limits have room, the budget not for 110
        await admitted(adm, tenant)
    assert adm.limiter.has_headroom(tenant)
    ticket = await adm.start(tenant, CallContext())
    assert ticket.one_call
    with pytest.raises(GatewayError) as info:
        await adm.finish(ticket, JOB, 100, CallContext())  # the pipeline's engine call is next
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "hourly" in info.value.message
    assert ticket.pending is None  # nothing left to answer after an engine call


async def test_without_budgets_the_admission_still_overlaps() -> None:
    adm = Admission(limiter())
    await admitted(adm, TENANT)
    ticket = await adm.start(TENANT, CallContext())
    await adm.finish(ticket, JOB, 100, CallContext())
    assert ticket.pending is not None  # answered while the engine starts
    await adm.confirm(ticket)
    await adm.settle(ticket, None, AttemptProgress(), False, None)
