"""Admission of one request against its tenant's limits and budgets, and its settlement.

The pipeline asks an ``Admission`` in stages; which Redis calls run where depends
on the tenant's headroom at its last admission here (``RateLimiter.has_headroom``)::

    two-call (near its limits, or unknown here):
      start: reserve ──► [encode, route] ──► take ──► finish: budgets ──► engine ──► settle
             (request unit + lease)           (tokens)

    one-call (headroom):
      start ──► [encode, route] ──► finish: reserve ──► budgets ──► engine ──► settle
                                   (request unit + lease + tokens)

    overlapped (headroom for this request too, no budget applies to it,
                ``gateway.overlap_admission``):
      start ──► [encode, route] ──► finish ──► engine call made ──► first chunk ──► settle
                                      │        (gate opens)           ▲
                                      └── task: reserve ──► budgets ──┘ confirm: none
                                          once the gate is open        before it passed

    an error before finish: abandon (the lease and tokens go back, the request unit stays spent)
    settle: exactly once on every ending (done, error, cancel), after an overlapped
            admission still in flight answered; what it refused charges nothing

``Admission.held`` keeps the lease alive while the stream runs (from the overlapped
admission's answer on); ``refusal`` maps a limiter decision to the GatewayError the
caller gets. Each stage's time is a ``gateway_stage_seconds`` label: ``reserve``,
``take`` and ``budget`` on the request's path, ``reserve_overlap`` for the overlapped
reservation that overlaps the engine's start.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass

import grpc

from common.log import get_logger
from gateway import metrics
from gateway.domain import CallContext, Chunk, GatewayError, Trace
from gateway.fleet.dispatcher import AttemptProgress, EngineJob
from gateway.request.budgets import BudgetGate
from gateway.request.detokenize import TextStream
from gateway.spans import stage
from ratelimit.budget.ledger import BudgetHold
from ratelimit.config import Tenant
from ratelimit.errors import LimiterUnavailableError
from ratelimit.limiter.decision import Decision, Reservation
from ratelimit.limiter.rate_limiter import RateLimiter
from ratelimit.status import denial_metadata, ratelimit_headers

log = get_logger(__name__)
_Held = tuple[Reservation | None, BudgetHold | None]


def refusal(tenant: Tenant, decision: Decision) -> GatewayError:
    """The RESOURCE_EXHAUSTED answer of a limiter refusal (counted per dimension)."""
    metrics.count_denial(tenant.tenant_id, decision.denied)
    retry = decision.retry_after_ms if decision.retry_after_ms >= 0 else None
    return GatewayError(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        decision.message(),
        retry_after_ms=retry,
        trailers=denial_metadata(decision),
    )


@dataclass(slots=True)
class AdmissionTicket:
    """What one request holds of its tenant's limits and budgets."""

    tenant: Tenant
    one_call: bool  # headroom at start: one reserve after the tokenizer
    reservation: Reservation | None = None
    budget_hold: BudgetHold | None = None
    # the overlapped admission still in flight while the engine starts
    pending: asyncio.Task[_Held] | None = None
    # opened once the engine call is out (or the stream ends without one): the
    # overlapped admission waits for it, so the engine request is sent first
    gate: asyncio.Future[None] | None = None
    # how that admission failed (refused, Redis down): the request fails, nothing is charged
    error: BaseException | None = None

    def open_gate(self) -> None:
        """Let the overlapped admission go (the engine call is out, or none will be)."""
        if self.gate is not None and not self.gate.done():
            self.gate.set_result(None)

    @property
    def on_dispatched(self) -> Callable[[], None] | None:
        """The dispatcher's ``on_dispatched`` callback (None: nothing waits for it)."""
        return self.open_gate if self.gate is not None else None


@dataclass(slots=True)
class Charge:
    """What a settled request was charged."""

    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    completion_tokens: int = 0


class Admission:
    """Reserve, take, budgets, the overlapped admission, confirm and settle.

    Args:
        limiter: Tenant limits on Redis.
        budgets: Tenant budgets (None = not enforced).
        overlap: ``gateway.overlap_admission``: a tenant with headroom for the request
            has its one call overlap the engine's start.
    """

    def __init__(
        self, limiter: RateLimiter, budgets: BudgetGate | None = None, *, overlap: bool = True
    ) -> None:
        self.limiter = limiter
        self.budgets = budgets
        self.overlap = overlap

    def refuse_known_denial(self, tenant: Tenant, call: CallContext) -> None:
        """Refuse before any tokenizer or Redis call a tenant whose request rate is
        known to be spent.

        Raises:
            GatewayError: RESOURCE_EXHAUSTED with the remaining wait.
        """
        memo = self.limiter.known_denial(tenant)
        if memo is not None:
            metrics.LOCAL_DENIALS.labels(tenant.tenant_id).inc()
            call.ratelimit.update(ratelimit_headers(memo, requests=True, tokens=False))
            raise refusal(tenant, memo)

    async def start(self, tenant: Tenant, call: CallContext) -> AdmissionTicket:
        """Before the tokenizer: near its limits (or unknown here), a caller gets the
        request unit and a lease now, so one over its request rate or concurrency never
        costs a tokenizer call (two Redis calls). With headroom, nothing yet: one call
        takes all three after the tokenizer (a wrong guess costs an encode).

        Raises:
            GatewayError: refused (RESOURCE_EXHAUSTED) or Redis unavailable.
        """
        ticket = AdmissionTicket(tenant, one_call=self.limiter.has_headroom(tenant))
        if not ticket.one_call:
            t0 = time.perf_counter()
            with stage(call.trace, "gateway.reserve"):
                ticket.reservation = await self._reserve(tenant, 0, call, tokens=False)
            metrics.STAGE_RESERVE.observe(time.perf_counter() - t0)
        return ticket

    async def take(self, ticket: AdmissionTicket, num_tokens: int, call: CallContext) -> None:
        """The two-call path's tokens, once the prompt is counted (nothing on the
        one-call path: its one call takes them)."""
        if ticket.reservation is None:
            return
        t0 = time.perf_counter()
        with stage(call.trace, "gateway.take"):
            try:
                decision = await self.limiter.take(ticket.tenant, ticket.reservation, num_tokens)
            except LimiterUnavailableError as e:
                raise GatewayError(grpc.StatusCode.UNAVAILABLE, str(e)) from None
            call.ratelimit.update(ratelimit_headers(decision, requests=False, tokens=True))
            if not decision.allowed:
                raise refusal(ticket.tenant, decision)
        metrics.STAGE_TAKE.observe(time.perf_counter() - t0)

    async def abandon(self, ticket: AdmissionTicket, call: CallContext) -> None:
        """Nothing was served (refused, a bad prompt, the client gone) before ``finish``:
        the lease and any tokens go back, the request unit stays spent. On the one-call
        path the request unit is spent here as the two-call path does, or invalid
        prompts would be tokenized for free, past the request rate."""
        if ticket.reservation is not None:
            await asyncio.shield(
                self.limiter.settle(ticket.reservation, prompt_tokens=0, completion_tokens=0)
            )
        elif ticket.one_call:
            await asyncio.shield(self._spend_request_unit(ticket.tenant, call))

    async def finish(
        self, ticket: AdmissionTicket, job: EngineJob, max_tokens: int, call: CallContext
    ) -> None:
        """The admission's last steps: the budgets (after the two-call path's take), or
        the one call and the budgets, or, when the tenant's headroom makes a refusal all
        but impossible, both overlap the engine's start: the engine starts now, the round
        trip runs during its prefill, and ``confirmed`` waits for it before the first
        chunk. From here on ``settle`` runs on every ending."""
        metrics.child(metrics.LIMIT_CALLS, "one" if ticket.one_call else "two").inc()
        tenant = ticket.tenant
        num_tokens = len(job.prompt_token_ids) + max_tokens
        if not ticket.one_call:
            ticket.budget_hold = await self._charge_budgets(
                tenant, job, max_tokens, ticket.reservation, call
            )
        elif (
            self.overlap
            and not self._budgeted(tenant, call)
            and self.limiter.claim_headroom(tenant, num_tokens)
        ):
            loop = asyncio.get_running_loop()
            gate = ticket.gate = loop.create_future()
            ticket.pending = loop.create_task(
                self._reserve_overlapped(gate, tenant, job, num_tokens, max_tokens, call)
            )
            metrics.OVERLAPPED_ADMISSIONS.inc()
        else:
            ticket.reservation, ticket.budget_hold = await self._reserve_and_charge(
                tenant, job, num_tokens, max_tokens, call
            )

    def _budgeted(self, tenant: Tenant, call: CallContext) -> bool:
        """Whether a budget applies to the request: then it never overlaps the engine's
        start, since a budget that refuses it must cost no engine work (the limits'
        headroom says nothing about a budget)."""
        return self.budgets is not None and bool(tenant.budgets or call.key_budgets)

    async def _reserve_and_charge(
        self,
        tenant: Tenant,
        job: EngineJob,
        num_tokens: int,
        max_tokens: int,
        call: CallContext,
        overlapped: bool = False,
    ) -> _Held:
        """The one-call path's admission: request unit, lease and tokens, then budgets.
        ``overlapped``: it overlaps the engine's start, so its time is recorded apart
        from the stages on the request's path."""
        t0 = time.perf_counter()
        with stage(call.trace, "gateway.reserve"):
            reservation = await self._reserve(tenant, num_tokens, call, tokens=True)
        (metrics.STAGE_RESERVE_OVERLAP if overlapped else metrics.STAGE_RESERVE).observe(
            time.perf_counter() - t0
        )
        hold = await self._charge_budgets(tenant, job, max_tokens, reservation, call)
        return reservation, hold

    async def _reserve_overlapped(
        self,
        gate: asyncio.Future[None],
        tenant: Tenant,
        job: EngineJob,
        num_tokens: int,
        max_tokens: int,
        call: CallContext,
    ) -> _Held:
        """The overlapped admission, once the engine call is on its way: the request's
        send goes first on this loop and the round trip during the prefill."""
        await gate
        # the gate may have opened before this task's first step: the call's request has
        # left already (common.eager_send), or, with LLM_EAGER_SEND=0, its send task,
        # queued when the gate opened, goes ahead of this one by one turn of the loop
        await asyncio.sleep(0)
        return await self._reserve_and_charge(
            tenant, job, num_tokens, max_tokens, call, overlapped=True
        )

    async def _charge_budgets(
        self,
        tenant: Tenant,
        job: EngineJob,
        max_tokens: int,
        reservation: Reservation | None,
        call: CallContext,
    ) -> BudgetHold | None:
        if self.budgets is None or not self._budgeted(tenant, call):
            return None
        try:
            prompt = len(job.prompt_token_ids)
            with stage(call.trace, "gateway.budget"):
                return await self.budgets.charge(tenant, job.model, prompt, max_tokens, call)
        except BaseException:
            # over budget (or the client left): the tokens go back, the request unit
            # stays spent, as for a token refusal
            if reservation is not None:
                await asyncio.shield(
                    self.limiter.settle(reservation, prompt_tokens=0, completion_tokens=0)
                )
            raise

    async def _reserve(
        self, tenant: Tenant, num_tokens: int, call: CallContext, *, tokens: bool
    ) -> Reservation | None:
        try:
            decision = await self.limiter.reserve(tenant, num_tokens)
        except LimiterUnavailableError as e:
            raise GatewayError(grpc.StatusCode.UNAVAILABLE, str(e)) from None
        call.ratelimit.update(ratelimit_headers(decision, requests=True, tokens=tokens))
        if not decision.allowed:
            raise refusal(tenant, decision)
        return decision.reservation

    async def _spend_request_unit(self, tenant: Tenant, call: CallContext) -> None:
        with contextlib.suppress(GatewayError):  # refused or unavailable: nothing to spend
            reservation = await self._reserve(tenant, 0, call, tokens=False)
            if reservation is not None:
                await self.limiter.settle(reservation, prompt_tokens=0, completion_tokens=0)

    async def confirmed(
        self, ticket: AdmissionTicket, chunks: AsyncGenerator[Chunk, None]
    ) -> AsyncGenerator[Chunk, None]:
        """The engine's chunks; none before the overlapped admission passed (a refusal
        closes the engine call and is the error, even over the engine's)."""
        confirmed = False  # once, before the first chunk: not on every token's path
        try:
            async with contextlib.aclosing(chunks):
                async for chunk in chunks:
                    if not confirmed:
                        await self.confirm(ticket)
                        confirmed = True
                    yield chunk
        except GatewayError:
            await self.confirm(ticket)
            raise

    async def confirm(self, ticket: AdmissionTicket, *, go: bool = True) -> None:
        """Wait for the overlapped admission (if any is still in flight); raise how it
        failed. Safe to call from several tasks: the first to see it done takes its
        result. ``go``: the admission may start now even if no engine call went out
        (the stream got its first chunk, failed or ended)."""
        if go:
            ticket.open_gate()
        pending = ticket.pending
        if pending is not None:
            try:
                await asyncio.shield(pending)
            except BaseException:
                # the admission's own failure is recorded below and raised after; this
                # task's own cancellation goes on
                me = asyncio.current_task()
                if not pending.done() or (me is not None and me.cancelling()):
                    raise
            finally:
                if pending.done() and ticket.pending is pending:
                    ticket.pending = None
                    self._take_result(ticket, pending)
        if ticket.error is not None:
            raise ticket.error

    @staticmethod
    def _take_result(ticket: AdmissionTicket, task: asyncio.Task[_Held]) -> None:
        if task.cancelled():  # only when the loop shuts down
            ticket.error = GatewayError(
                grpc.StatusCode.UNAVAILABLE, "the gateway stopped during admission; retry"
            )
        elif (error := task.exception()) is not None:
            ticket.error = error
            if isinstance(error, GatewayError):
                metrics.OVERLAP_REFUSALS.inc()
        else:
            ticket.reservation, ticket.budget_hold = task.result()

    @contextlib.asynccontextmanager
    async def held(
        self, ticket: AdmissionTicket, on_admitted: Callable[[], None]
    ) -> AsyncIterator[None]:
        """While the stream runs: the lease heartbeat, and ``on_admitted`` (the shadow
        copy) once the request is admitted: at once, or once the overlapped admission
        answered (the lease is heartbeated from the answer on, chunk or not)."""
        if ticket.pending is None:
            async with self.limiter.keep_alive(ticket.reservation):
                on_admitted()
                yield
            return
        stop = asyncio.Event()

        async def follow() -> None:
            with contextlib.suppress(Exception):  # the relay reports how it failed
                await self.confirm(ticket, go=False)
            if ticket.error is None and not stop.is_set():  # not for a stream already over
                async with self.limiter.keep_alive(ticket.reservation):
                    on_admitted()
                    await stop.wait()

        task = asyncio.get_running_loop().create_task(follow(), name="admission-follow")
        try:
            yield
        finally:
            stop.set()
            ticket.open_gate()  # the stream is over, engine call or not
            await asyncio.shield(task)  # bounded: the admission has its own timeouts

    async def settle(
        self,
        ticket: AdmissionTicket,
        text: TextStream | None,
        progress: AttemptProgress,
        client_left: bool,
        trace: Trace | None,
    ) -> Charge:
        """Charge what was used and give back the rest of the reservation, once an
        overlapped admission still in flight answered (a reservation it made is settled
        like any other; how it failed was recorded).

        The prompt is charged once an engine answered, or once it was sent to an
        engine and the client left (cancel, deadline) before the answer: prefill
        work it started is not free. An engine's refusal or failure charges nothing.
        """
        with contextlib.suppress(Exception):
            await self.confirm(ticket)
        prompt = 0
        if ticket.error is not None:  # refused while the engine started: work undone
            text = None
        elif text is not None and (
            progress.engine_answered or (progress.dispatched and client_left)
        ):
            prompt = text.num_prompt_tokens
        completion = len(text.token_ids) if text is not None else 0
        cached = min(prompt, text.num_cached_tokens) if text else 0
        tenant = ticket.tenant.tenant_id
        metrics.child(metrics.TOKENS_CHARGED, tenant, "prompt").inc(prompt)
        metrics.child(metrics.TOKENS_CHARGED, tenant, "completion").inc(completion)
        with stage(trace, "gateway.settle"):
            if ticket.reservation is not None:
                await self.limiter.settle(
                    ticket.reservation, prompt_tokens=prompt, completion_tokens=completion
                )
            if ticket.budget_hold is not None and self.budgets is not None:
                await self.budgets.settle(ticket.budget_hold, prompt, completion)
        log.info(
            "request settled",
            prompt_tokens=prompt,
            completion_tokens=completion,
            finish_reason=int(text.finish_reason) if text is not None else 0,
        )
        return Charge(prompt, cached, completion)
