"""Admission over the in-memory limiter store: the two-call, one-call and overlapped
paths, what abandon gives back, and settlement charging exactly what was used, once."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from gateway import metrics
from gateway.domain import CallContext, GatewayError
from gateway.fleet.dispatcher import AttemptProgress
from gateway.request.admission import Admission, AdmissionTicket, Charge, refusal
from gateway.request.budgets import BudgetGate
from gateway.request.detokenize import TextStream
from llm.v1 import common_pb2, engine_pb2
from ratelimit.budget.policy import Budget, Metric, Period, PriceTable
from ratelimit.config import Dimension, LimitPolicy, Tenant
from ratelimit.limiter.rate_limiter import RateLimiter
from tests.support.clock import FakeClock
from tests.unit.gateway.request.fakes import (
    TENANT,
    FlakyStore,
    Ledgers,
    engine_job,
    limiter,
    open_holds,
    used,
)
from tokenizer_svc.tokenizer import TextTokenizer

JOB = engine_job(num_prompt=10, max_tokens=100)  # 110 tokens reserved
NUM_TOKENS = 110


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> TextTokenizer:
    return TextTokenizer(model_dir)


def answered(tokenizer: TextTokenizer, num_tokens: int) -> tuple[TextStream, AttemptProgress]:
    """The stream and progress of a request an engine answered with ``num_tokens``."""
    text = TextStream("r", tokenizer, [], len(JOB.prompt_token_ids))
    for i in range(num_tokens):
        resp = engine_pb2.EngineGenerateResponse(token_ids=[504 + i])
        if i == num_tokens - 1:
            resp.finish_reason = common_pb2.LENGTH
            resp.usage.cached_prompt_tokens = 4
        text.on_engine_chunk(resp)
    return text, AttemptProgress(dispatched=True, engine_answered=True)


async def levels(lim: RateLimiter, tenant: Tenant = TENANT) -> tuple[int, float, int]:
    """(requests available, rounded; tokens available; leases in use)."""
    u = await lim.usage(tenant)
    return round(u.requests_available), u.tokens_available, u.concurrent_in_use


async def seed_headroom(adm: Admission, tenant: Tenant = TENANT) -> None:
    """One whole request, so the limiter has seen the tenant's levels (headroom)."""
    ticket = await adm.start(tenant, CallContext())
    await adm.take(ticket, 1, CallContext())
    await adm.finish(ticket, JOB, 0, CallContext())
    await adm.settle(ticket, None, AttemptProgress(), False, None)
    assert adm.limiter.has_headroom(tenant)


async def test_two_call_path_leases_before_the_prompt_takes_after_and_settles_exactly(
    tokenizer: TextTokenizer,
) -> None:
    lim = limiter()
    adm = Admission(lim)
    call = CallContext()
    ticket = await adm.start(TENANT, call)
    assert not ticket.one_call  # nothing known of the tenant here yet
    assert ticket.reservation is not None
    assert await levels(lim) == (599, 6000, 1)  # a unit and a lease, no tokens
    await adm.take(ticket, NUM_TOKENS, call)
    assert (await levels(lim))[1] == 6000 - NUM_TOKENS
    assert "x-ratelimit-remaining-tokens" in call.ratelimit
    await adm.finish(ticket, JOB, 100, call)
    text, progress = answered(tokenizer, 3)
    charge = await adm.settle(ticket, text, progress, False, None)
    assert charge == Charge(prompt_tokens=10, cached_prompt_tokens=4, completion_tokens=3)
    assert await levels(lim) == (599, 6000 - 13, 0)  # 97 back, lease gone
    assert len(lim.settles) == 1


async def test_a_refused_take_raises_and_abandon_gives_back_the_lease_not_the_request_unit() -> (
    None
):
    lim = limiter()
    adm = Admission(lim)
    ticket = await adm.start(TENANT, CallContext())
    with pytest.raises(GatewayError) as info:
        await adm.take(ticket, 7000, CallContext())  # over the token bucket
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "tokens_per_minute" in info.value.message
    await adm.abandon(ticket, CallContext())
    assert await levels(lim) == (599, 6000, 0)
    assert ticket.reservation is not None
    assert lim.settles == [(ticket.reservation.lease_id, 0, 0)]


async def test_one_call_path_takes_everything_after_the_prompt_and_abandon_spends_a_unit() -> None:
    lim = limiter()
    adm = Admission(lim, overlap=False)
    await seed_headroom(adm)
    before = await levels(lim)
    ticket = await adm.start(TENANT, CallContext())
    assert ticket.one_call
    assert ticket.reservation is None
    assert await levels(lim) == before
    await adm.take(ticket, NUM_TOKENS, CallContext())  # nothing to take on this path
    await adm.finish(ticket, JOB, 100, CallContext())
    assert ticket.reservation is not None
    assert ticket.pending is None
    assert await levels(lim) == (before[0] - 1, before[1] - NUM_TOKENS, 1)
    await adm.settle(ticket, None, AttemptProgress(), False, None)  # nothing served
    assert await levels(lim) == (before[0] - 1, before[1], 0)
    # a prompt refused before the one call still spends its request unit
    ticket = await adm.start(TENANT, CallContext())
    await adm.abandon(ticket, CallContext())
    assert await levels(lim) == (before[0] - 2, before[1], 0)


async def test_the_overlapped_admission_waits_for_the_engine_call_then_holds_until_settled(
    tokenizer: TextTokenizer,
) -> None:
    lim = limiter()
    adm = Admission(lim)
    await seed_headroom(adm)
    overlapped = metrics.OVERLAPPED_ADMISSIONS._value.get()
    ticket = await adm.start(TENANT, CallContext())
    await adm.finish(ticket, JOB, 100, CallContext())
    assert ticket.pending is not None
    assert ticket.on_dispatched is not None
    assert metrics.OVERLAPPED_ADMISSIONS._value.get() == overlapped + 1
    for _ in range(3):
        await asyncio.sleep(0)
    assert (await levels(lim))[2] == 0  # the gate is shut: no Redis call before the engine's
    ticket.on_dispatched()  # the engine call is out
    await adm.confirm(ticket)
    assert ticket.reservation is not None
    assert ticket.pending is None
    assert (await levels(lim))[1:] == (6000 - NUM_TOKENS, 1)
    text, progress = answered(tokenizer, 2)
    assert await adm.settle(ticket, text, progress, False, None) == Charge(10, 4, 2)
    assert (await levels(lim))[1:] == (6000 - 12, 0)
    assert len(lim.settles) == 2  # the seed's and this one's


async def test_an_overlapped_admission_another_replica_made_stale_is_refused_and_charges_nothing(
    tokenizer: TextTokenizer,
) -> None:
    lim = limiter()
    adm = Admission(lim)
    await seed_headroom(adm)
    other = RateLimiter(lim.store)  # another gateway replica on the same store
    spent = await other.reserve(TENANT, 5900)  # leaves less than this request needs
    assert spent.allowed
    refusals = metrics.OVERLAP_REFUSALS._value.get()
    ticket = await adm.start(TENANT, CallContext())
    await adm.finish(ticket, JOB, 100, CallContext())
    assert ticket.pending is not None
    with pytest.raises(GatewayError) as info:
        await adm.confirm(ticket)  # the first chunk's wait: opens the gate itself
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert metrics.OVERLAP_REFUSALS._value.get() == refusals + 1
    text, progress = answered(tokenizer, 2)  # the engine had started: its work is undone
    assert await adm.settle(ticket, text, progress, False, None) == Charge()
    assert (await levels(lim))[2] == 1  # only the other replica's lease
    assert len(lim.settles) == 1  # the seed's: nothing was reserved, nothing settled


async def test_a_store_failure_during_the_overlapped_admission_fails_closed_holding_nothing() -> (
    None
):
    lim = limiter(fail_mode="closed")
    adm = Admission(lim)
    await seed_headroom(adm)
    ticket = await adm.start(TENANT, CallContext())
    await adm.finish(ticket, JOB, 100, CallContext())
    store = lim.store
    assert isinstance(store, FlakyStore)
    store.down = True
    assert ticket.on_dispatched is not None
    ticket.on_dispatched()
    with pytest.raises(GatewayError) as info:
        await adm.confirm(ticket)
    assert info.value.code == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(GatewayError):  # every later wait reports the same failure
        await adm.confirm(ticket)
    store.down = False
    assert await adm.settle(ticket, None, AttemptProgress(), True, None) == Charge()
    assert (await levels(lim))[2] == 0
    assert len(lim.settles) == 1  # the seed's


async def test_held_starts_what_follows_an_admission_only_once_admitted() -> None:
    lim = limiter()
    adm = Admission(lim)
    admitted: list[str] = []
    ticket = await adm.start(TENANT, CallContext())  # two-call: admitted already
    async with adm.held(ticket, lambda: admitted.append("now")):
        assert admitted == ["now"]
    await seed_headroom(adm)
    other = RateLimiter(lim.store)
    assert (await other.reserve(TENANT, 5900)).allowed  # this replica's memo is stale
    refused = await adm.start(TENANT, CallContext())
    await adm.finish(refused, JOB, 100, CallContext())
    async with adm.held(refused, lambda: admitted.append("refused")):
        assert refused.on_dispatched is not None
        refused.on_dispatched()
        with pytest.raises(GatewayError):
            await adm.confirm(refused)
    assert admitted == ["now"]  # no shadow copy of a request its admission refused


async def test_a_budget_refusal_gives_the_tokens_back_and_settle_charges_the_budget_exactly(
    tokenizer: TextTokenizer, ledgers: Ledgers
) -> None:
    ledger = ledgers.up(FakeClock(1_700_000_000.0))
    lim = limiter()
    gate = BudgetGate(ledger, PriceTable(), "open")
    adm = Admission(lim, gate, overlap=False)
    daily = Budget("daily", Metric.TOKENS, Period.DAY, 150, warn_percent=0)
    tenant = Tenant("acme", TENANT.limits, budgets=(daily,))
    ticket = await adm.start(tenant, CallContext())
    await adm.take(ticket, NUM_TOKENS, CallContext())
    await adm.finish(ticket, JOB, 100, CallContext())  # 110 of 150 held
    assert ticket.budget_hold is not None
    over = await adm.start(tenant, CallContext())  # one call: reserve, then the budgets
    await adm.take(over, NUM_TOKENS, CallContext())
    with pytest.raises(GatewayError) as info:
        await adm.finish(over, JOB, 100, CallContext())  # 110 more do not fit
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "daily" in info.value.message
    assert (await levels(lim, tenant))[1:] == (6000 - NUM_TOKENS, 1)  # its tokens went back
    text, progress = answered(tokenizer, 3)
    await adm.settle(ticket, text, progress, False, None)
    assert await used(ledger, "acme", daily) == 13
    assert await open_holds(ledger, "acme") == 0


async def test_a_known_denial_is_refused_without_a_store_call() -> None:
    lim = limiter()
    adm = Admission(lim)
    tenant = Tenant("slow", LimitPolicy(requests_per_minute=1))
    ticket = await adm.start(tenant, CallContext())
    await adm.settle(ticket, None, AttemptProgress(), False, None)
    with pytest.raises(GatewayError):
        await adm.start(tenant, CallContext())  # the store refuses, the memo remembers
    before = (await lim.usage(tenant)).requests_denied_total
    call = CallContext()
    with pytest.raises(GatewayError) as info:
        adm.refuse_known_denial(tenant, call)
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert info.value.retry_after_ms is not None
    assert info.value.retry_after_ms > 0
    assert call.ratelimit  # the x-ratelimit-* headers of the refusal
    assert (await lim.usage(tenant)).requests_denied_total == before  # no store call
    adm.refuse_known_denial(TENANT, CallContext())  # another tenant: nothing known


async def test_refusal_maps_a_decision_to_resource_exhausted_with_its_wait_and_details() -> None:
    lim = limiter()
    tenant = Tenant("small", LimitPolicy(max_concurrent=1))
    assert (await lim.reserve(tenant, 0)).allowed
    decision = await lim.reserve(tenant, 0)
    assert decision.denied == Dimension.CONCURRENCY
    error = refusal(tenant, decision)
    assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert error.message == decision.message()
    assert error.retry_after_ms == decision.retry_after_ms == 500
    keys = [k for k, _ in error.metadata()]
    assert "retry-after-ms" in keys
    assert any(k.endswith("-bin") for k in keys)  # the QuotaFailure details


def test_on_dispatched_opens_the_gate_once_and_is_none_without_one() -> None:
    assert AdmissionTicket(TENANT, one_call=True).on_dispatched is None
    loop = asyncio.new_event_loop()
    try:
        ticket = AdmissionTicket(TENANT, one_call=True, gate=loop.create_future())
        assert ticket.on_dispatched is not None
        ticket.on_dispatched()
        ticket.on_dispatched()  # a second engine call (a retry): no error
        assert ticket.gate is not None
        assert ticket.gate.done()
    finally:
        loop.close()
