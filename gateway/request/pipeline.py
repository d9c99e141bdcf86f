"""The request pipeline: one object every front calls (docs/architecture.md).

    auth ─► model, params ─► reserve ─► encode ─► context ─► version ─► take ─► budget ─► engine
    (bearer) (ModelInfo)     (Redis: 1   (tokenizer) (length)  (routing   (Redis:  (Redis,   (route,
                             request,                          policy,    tokens)  if the    retry,
                             1 lease)                          shadow)             tenant    fail-
                                                                                   has any)  over)
                             └── settle exactly once on every ending: done, error, cancel ──┘

The model step resolves model routes (``gateway.request.models``): an alias or
fallback chain picks its first target with a ready replica there, and moves on
at the context step when the counted prompt and the requested output do not fit
that target.

Usage from any front (the gRPC servicer today, the OpenAI-compatible HTTP
front later)::

    call = CallContext(authorization=..., request_id=..., traceparent=..., timeout_s=...)
    async with contextlib.aclosing(pipeline.generate(request, call)) as chunks:
        async for chunk in chunks:      # gateway.domain.Chunk
            ...                         # write it in the front's format
    # GatewayError (code, message, retry_after_ms, metadata()) ends a call early; an
    # error before the first chunk means nothing was sent (fronts may map it to a
    # plain HTTP status). Closing the generator (client gone) cancels the engine
    # call at once and settles the tokens produced so far.

The pipeline knows nothing of its front: inputs are the ``llm.v1``
GenerateRequest and a ``CallContext``; outputs are ``Chunk``s.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field

import grpc
import structlog

from common import tracing
from common.log import get_logger
from gateway import metrics
from gateway.config import GatewayConfig
from gateway.domain import CallContext, Chunk, Deadline, GatewayError, engine_request_id
from gateway.fleet.dispatcher import AttemptProgress, Dispatcher, EngineJob
from gateway.fleet.replica_pool import ModelEntry, ReplicaPool
from gateway.fleet.tokenizers import TokenizerSet
from gateway.release.shadow import ShadowMirror
from gateway.release.version_router import RouteDecision, VersionRouter
from gateway.request.authenticate import Authenticator
from gateway.request.budgets import BudgetGate
from gateway.request.detokenize import TextStream
from gateway.request.encode import Encoder, check_prompt_size
from gateway.request.models import Choice, ModelChooser
from gateway.request.params import (
    engine_sampling,
    request_priority,
    resolve_max_tokens,
    validate_sampling,
    validate_stop_token_ids,
)
from gateway.spans import RequestTrace, stage
from llm.v1 import gateway_pb2
from ratelimit.budget.ledger import BudgetHold
from ratelimit.budget.policy import PriceTable
from ratelimit.config import Tenant
from ratelimit.errors import LimiterUnavailableError
from ratelimit.limiter.decision import Decision, Reservation
from ratelimit.limiter.rate_limiter import RateLimiter
from ratelimit.status import denial_metadata, ratelimit_headers
from ratelimit.usage.records import UsageEvent, UsageLog
from tokenizer_svc.tokenizer import TextTokenizer

log = get_logger(__name__)


@dataclass(slots=True)
class _Admitted:
    tenant: Tenant
    job: EngineJob
    reservation: Reservation | None
    tokenizer: TextTokenizer
    shadow_version: str = ""
    budget_hold: BudgetHold | None = None
    # the reservation (and budget charge) still in flight while the engine starts
    pending: asyncio.Task[tuple[Reservation | None, BudgetHold | None]] | None = None
    # opened once the engine call is out (or the stream ends without one): the
    # admission above waits for it, so the engine request is sent first
    gate: asyncio.Future[None] | None = None
    # how that admission failed (refused, Redis down): the request fails, nothing is charged
    error: BaseException | None = None
    progress: AttemptProgress = field(default_factory=AttemptProgress)  # the engine attempts'


@dataclass(slots=True)
class _Labels:
    model: str = ""  # set once the model is known (no client strings as label values)
    version: str = ""
    prompt_tokens: int = 0  # what the request was charged (set when it settles)
    cached_prompt_tokens: int = 0
    completion_tokens: int = 0


def _open(gate: asyncio.Future[None]) -> None:
    if not gate.done():
        gate.set_result(None)


class Pipeline:
    """auth -> reserve -> encode -> validate -> route -> take -> stream -> settle.

    Args:
        config: The gateway section.
        auth: Bearer key -> tenant.
        encoder: Prompt encoding (in process, or tokenizer_svc).
        tokenizers: Each model's tokenizer (encoding, incremental detokenization).
        limiter: Tenant limits on Redis.
        pool: Engine replicas.
        dispatcher: Engine attempts (retries, failover).
        router: Model version by routing policy (None = any version, by load).
        shadow: Shadow copies to candidate versions (None = off).
        models: Request model names through the model routes (default: names as given).
        budgets: Tenant budgets (None = not enforced).
        usage: Where finished requests are recorded (None = nowhere).
        prices: USD per million tokens per model (the cost of usage records).
    """

    def __init__(
        self,
        config: GatewayConfig,
        auth: Authenticator,
        encoder: Encoder,
        tokenizers: TokenizerSet,
        limiter: RateLimiter,
        pool: ReplicaPool,
        dispatcher: Dispatcher,
        router: VersionRouter | None = None,
        shadow: ShadowMirror | None = None,
        models: ModelChooser | None = None,
        budgets: BudgetGate | None = None,
        usage: UsageLog | None = None,
        prices: PriceTable | None = None,
    ) -> None:
        self.config = config
        self.auth = auth
        self.encoder = encoder
        self.tokenizers = tokenizers
        self.limiter = limiter
        self.pool = pool
        self.dispatcher = dispatcher
        self.router = router
        self.shadow = shadow
        self.models = models or ModelChooser(pool)
        self.budgets = budgets
        self.usage = usage
        self.prices = prices or PriceTable()
        self.draining = False
        self.num_in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    async def list_models(self, call: CallContext) -> list[ModelEntry]:
        """Models the caller's tenant may use, with versions and replica counts."""
        tenant = await self.auth.tenant(call)
        entries = await self.models.with_routes(self.pool.catalog())
        entries = [e for e in entries if tenant.allows_model(e.model)]
        return await self.router.annotate(entries) if self.router is not None else entries

    async def generate(
        self, request: gateway_pb2.GenerateRequest, call: CallContext
    ) -> AsyncGenerator[Chunk, None]:
        """Stream one completion; see the module docstring for the contract.

        Raises:
            GatewayError: with the status code and message for the caller.
        """
        start = time.perf_counter()
        tenant_label, code = "unauthenticated", grpc.StatusCode.OK
        tenant_id = ""  # set once authenticated: then the request is recorded
        labels = _Labels()
        if (tracer := tracing.tracer()) is not None:
            call.trace = RequestTrace(tracer, call, start)  # its trace id is the logs' too
        structlog.contextvars.bind_contextvars(request_id=call.request_id, trace_id=call.trace_id)
        try:
            self._enter()
        except GatewayError as e:
            if call.trace is not None:
                call.trace.finish(e.code, {})
            raise
        try:
            if call.tenant is None:
                t0 = time.perf_counter()
                with stage(call.trace, "gateway.auth"):
                    tenant = await self.auth.tenant(call)
                metrics.STAGE_AUTH.observe(time.perf_counter() - t0)
            else:
                tenant = call.tenant
            tenant_label = tenant_id = tenant.tenant_id
            structlog.contextvars.bind_contextvars(tenant=tenant.tenant_id)
            if call.request_id_error:
                raise GatewayError(grpc.StatusCode.INVALID_ARGUMENT, call.request_id_error)
            admitted = await self._admit(request, call, tenant)
            labels.model, labels.version = admitted.job.model, admitted.job.model_version
            async for chunk in self._serve(admitted, start, labels):
                yield chunk
        except GatewayError as e:
            code = e.code
            raise
        except (asyncio.CancelledError, GeneratorExit):
            code = grpc.StatusCode.CANCELLED
            raise
        except Exception:
            code = grpc.StatusCode.INTERNAL
            log.exception("generate failed")
            raise GatewayError(
                code,
                f"internal gateway error; see the gateway log with request id {call.request_id}",
            ) from None
        finally:
            self._leave()
            metrics.REQUESTS.labels(tenant_label, code.name, labels.model, labels.version).inc()
            metrics.E2E.labels(labels.model, labels.version).observe(time.perf_counter() - start)
            if tenant_id and self.usage is not None:
                self._record(tenant_id, call.key_id, code, labels)
            if call.trace is not None:
                call.trace.finish(code, self._span_attributes(tenant_id, labels))

    @staticmethod
    def _span_attributes(tenant_id: str, labels: _Labels) -> dict[str, str | int]:
        return {
            "llm.tenant_id": tenant_id,
            "gen_ai.request.model": labels.model,
            "llm.model_version": labels.version,
            "gen_ai.usage.input_tokens": labels.prompt_tokens,
            "gen_ai.usage.output_tokens": labels.completion_tokens,
            "llm.cached_prompt_tokens": labels.cached_prompt_tokens,
        }

    def _record(self, tenant_id: str, key_id: str, code: grpc.StatusCode, labels: _Labels) -> None:
        assert self.usage is not None
        price = self.prices.price(labels.model)
        self.usage.record(
            UsageEvent(
                tenant_id=tenant_id,
                key_id=key_id,
                model=labels.model,
                model_version=labels.version,
                status=code.name,
                prompt_tokens=labels.prompt_tokens,
                cached_prompt_tokens=labels.cached_prompt_tokens,
                completion_tokens=labels.completion_tokens,
                cost_usd=price.cost(labels.prompt_tokens, labels.completion_tokens),
            )
        )

    def _enter(self) -> None:
        if self.draining:
            raise GatewayError(
                grpc.StatusCode.UNAVAILABLE,
                "this gateway replica is shutting down; retry on another",
            )
        self.num_in_flight += 1
        self._idle.clear()
        metrics.IN_FLIGHT.inc()

    def _leave(self) -> None:
        self.num_in_flight -= 1
        metrics.IN_FLIGHT.dec()
        if self.num_in_flight == 0:
            self._idle.set()

    async def _admit(
        self, request: gateway_pb2.GenerateRequest, call: CallContext, tenant: Tenant
    ) -> _Admitted:
        name = request.model or self.pool.default_model()
        choice = await self.models.choose(name, request.model_version)
        if not choice.candidates:
            raise self._unknown_model(name, request.model_version, choice)
        self.auth.check_model(tenant, name)  # a route's targets are reached by its name
        info = choice.info
        try:
            validate_sampling(request.sampling, info.vocab_size)
            validate_stop_token_ids(request.sampling, info.vocab_size)
            priority = request_priority(request.priority, tenant.priority)
        except ValueError as e:
            raise GatewayError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        deadline = Deadline.for_client(
            call.timeout_s, self.config.request_timeout_s, self.config.max_request_timeout_s
        )
        memo = self.limiter.known_denial(tenant)
        if memo is not None:  # refused before any tokenizer or Redis call
            metrics.LOCAL_DENIALS.labels(tenant.tenant_id).inc()
            call.ratelimit.update(ratelimit_headers(memo, requests=True, tokens=False))
            raise self._denied(tenant, memo)
        # a prompt no context could hold is refused before it spends a request unit
        check_prompt_size(request, choice.max_context_length)
        tokenizer = self.tokenizers.get(info)
        if tokenizer is None:
            raise GatewayError(
                grpc.StatusCode.UNAVAILABLE,
                f"model {choice.model!r} has no ready replica yet (its tokenizer is not "
                "loaded); retry shortly",
            )
        # Near its limits (or unknown here), a caller gets the request unit and a lease
        # before the tokenizer: one over its request rate or concurrency never costs a
        # tokenizer call, and tokens are taken once the prompt is counted (two Redis
        # calls). With headroom at its last admission, one call takes all three after
        # the tokenizer (a wrong guess costs an encode; Redis still decides).
        one_call = self.limiter.has_headroom(tenant)
        reservation: Reservation | None = None
        t0 = time.perf_counter()
        if not one_call:
            with stage(call.trace, "gateway.reserve"):
                reservation = await self._reserve(tenant, 0, call, tokens=False)
            metrics.STAGE_RESERVE.observe(time.perf_counter() - t0)
        t1 = time.perf_counter()
        try:
            with stage(call.trace, "gateway.encode"):
                prompt_ids = await self.encoder.encode(request, call, deadline, tokenizer)
            t2 = time.perf_counter()
            metrics.STAGE_ENCODE.observe(t2 - t1)
            # a route's next target when the prompt and the asked-for output do not fit
            choice.fit(
                len(prompt_ids), max(request.sampling.max_tokens, request.sampling.min_tokens)
            )
            model, info = choice.model, choice.info
            try:
                max_tokens = resolve_max_tokens(
                    request.sampling,
                    len(prompt_ids),
                    info.max_context_length,
                    self.config.default_max_tokens,
                    self.config.max_max_tokens,
                )
            except ValueError as e:
                raise GatewayError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
            with stage(call.trace, "gateway.route"):
                route = await self._route(model, choice.version, tenant, call)
            t3 = time.perf_counter()
            metrics.STAGE_ROUTE.observe(t3 - t2)
            engine_id = engine_request_id(tenant.tenant_id)
            structlog.contextvars.bind_contextvars(engine_request_id=engine_id)
            job = EngineJob(
                request_id=engine_id,
                correlation_id=call.request_id,
                traceparent=call.traceparent,
                tenant_id=tenant.tenant_id,
                tenant_weight=float(tenant.fair_share),
                priority=priority,
                model=model,
                model_version=route.version,
                prompt_token_ids=prompt_ids,
                sampling=engine_sampling(request.sampling, max_tokens),
                deadline=deadline,
                stop_strings=list(request.sampling.stop),
                fallback_versions=route.fallbacks,
                trace=call.trace,
            )
            num_tokens = len(prompt_ids) + max_tokens
            if reservation is not None:
                with stage(call.trace, "gateway.take"):
                    await self._take(tenant, reservation, num_tokens, call)
                metrics.STAGE_TAKE.observe(time.perf_counter() - t3)
        except BaseException:
            # nothing was served: the lease and any tokens go back, the request unit stays
            # spent; from a successful take on, _serve's finally settles on every path
            if reservation is not None:
                await asyncio.shield(
                    self.limiter.settle(reservation, prompt_tokens=0, completion_tokens=0)
                )
            elif one_call:
                # refused (a bad prompt, the client gone) before the one call: spend the
                # request unit as the two-call path does, or invalid prompts would be
                # tokenized for free, past the request rate
                await asyncio.shield(self._spend_request_unit(tenant, call))
            raise
        metrics.LIMIT_CALLS.labels("one" if one_call else "two").inc()
        admitted = _Admitted(tenant, job, reservation, tokenizer, route.shadow_version)
        await self._hold(admitted, one_call, num_tokens, max_tokens, call)
        return admitted

    async def _hold(
        self,
        admitted: _Admitted,
        one_call: bool,
        num_tokens: int,
        max_tokens: int,
        call: CallContext,
    ) -> None:
        """The admission's last steps: the one call (or, after the two-call path's
        take, the budgets), or, when the tenant's headroom makes a refusal all but
        impossible, both started beside the engine: the engine starts now, the round
        trip runs during its prefill, and ``_serve`` waits for it before the first chunk."""
        tenant, job = admitted.tenant, admitted.job
        if not one_call:
            admitted.budget_hold = await self._charge_budgets(
                tenant, job, max_tokens, admitted.reservation, call
            )
        elif self.config.overlap_admission and self.limiter.claim_headroom(tenant, num_tokens):
            loop = asyncio.get_running_loop()
            gate = admitted.gate = loop.create_future()
            admitted.pending = loop.create_task(
                self._reserve_after(gate, tenant, job, num_tokens, max_tokens, call)
            )
            metrics.OVERLAPPED_ADMISSIONS.inc()
        else:
            admitted.reservation, admitted.budget_hold = await self._reserve_and_charge(
                tenant, job, num_tokens, max_tokens, call
            )

    async def _reserve_and_charge(
        self,
        tenant: Tenant,
        job: EngineJob,
        num_tokens: int,
        max_tokens: int,
        call: CallContext,
        beside: bool = False,
    ) -> tuple[Reservation | None, BudgetHold | None]:
        """The one-call path's admission: request unit, lease and tokens, then budgets.
        ``beside``: it runs beside the engine's start, so its time is recorded apart
        from the stages on the request's path."""
        t0 = time.perf_counter()
        with stage(call.trace, "gateway.reserve"):
            reservation = await self._reserve(tenant, num_tokens, call, tokens=True)
        (metrics.STAGE_RESERVE_BESIDE if beside else metrics.STAGE_RESERVE).observe(
            time.perf_counter() - t0
        )
        hold = await self._charge_budgets(tenant, job, max_tokens, reservation, call)
        return reservation, hold

    async def _reserve_after(
        self,
        gate: asyncio.Future[None],
        tenant: Tenant,
        job: EngineJob,
        num_tokens: int,
        max_tokens: int,
        call: CallContext,
    ) -> tuple[Reservation | None, BudgetHold | None]:
        """The admission beside the engine, once the engine call is on its way: the
        request's send goes first on this loop and the round trip during the prefill."""
        await gate
        # the gate may have opened before this task's first step: the call's send task,
        # queued when it opened, goes ahead of this one by one turn of the loop
        await asyncio.sleep(0)
        return await self._reserve_and_charge(
            tenant, job, num_tokens, max_tokens, call, beside=True
        )

    async def _charge_budgets(
        self,
        tenant: Tenant,
        job: EngineJob,
        max_tokens: int,
        reservation: Reservation | None,
        call: CallContext,
    ) -> BudgetHold | None:
        if self.budgets is None or not (tenant.budgets or call.key_budgets):
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

    async def _route(
        self, model: str, version: str, tenant: Tenant, call: CallContext
    ) -> RouteDecision:
        if self.router is None:
            return RouteDecision(version, reason="request" if version else "any")
        return await self.router.decide(model, version, tenant.tenant_id, call.session_key)

    def _unknown_model(self, model: str, version: str, choice: Choice) -> GatewayError:
        known = self.pool.catalog()
        if not known:
            return GatewayError(
                grpc.StatusCode.UNAVAILABLE,
                "no engine replica is reachable yet, so no model is known: "
                + self.pool.explain(model, version, set()),
            )
        if choice.is_route:
            return GatewayError(
                grpc.StatusCode.NOT_FOUND,
                f"model route {model!r} sends requests to "
                f"{', '.join(str(t) for t in choice.targets)}, and no engine replica serves "
                f"any of them; available: {', '.join(e.model for e in known)}",
            )
        if version and any(e.model == model for e in known):
            versions = sorted(v for e in known if e.model == model for v in e.versions)
            return GatewayError(
                grpc.StatusCode.NOT_FOUND,
                f"model {model!r} has no version {version!r}; known versions: "
                f"{', '.join(versions)} (leave model_version empty for any)",
            )
        return GatewayError(
            grpc.StatusCode.NOT_FOUND,
            f"unknown model {model!r}; available: "
            f"{', '.join(e.model for e in known)} (empty = the default)",
        )

    async def _reserve(
        self, tenant: Tenant, num_tokens: int, call: CallContext, *, tokens: bool
    ) -> Reservation | None:
        try:
            decision = await self.limiter.reserve(tenant, num_tokens)
        except LimiterUnavailableError as e:
            raise GatewayError(grpc.StatusCode.UNAVAILABLE, str(e)) from None
        call.ratelimit.update(ratelimit_headers(decision, requests=True, tokens=tokens))
        if not decision.allowed:
            raise self._denied(tenant, decision)
        return decision.reservation

    async def _spend_request_unit(self, tenant: Tenant, call: CallContext) -> None:
        with contextlib.suppress(GatewayError):  # refused or unavailable: nothing to spend
            reservation = await self._reserve(tenant, 0, call, tokens=False)
            if reservation is not None:
                await self.limiter.settle(reservation, prompt_tokens=0, completion_tokens=0)

    async def _take(
        self, tenant: Tenant, reservation: Reservation, num_tokens: int, call: CallContext
    ) -> None:
        try:
            decision = await self.limiter.take(tenant, reservation, num_tokens)
        except LimiterUnavailableError as e:
            raise GatewayError(grpc.StatusCode.UNAVAILABLE, str(e)) from None
        call.ratelimit.update(ratelimit_headers(decision, requests=False, tokens=True))
        if not decision.allowed:
            raise self._denied(tenant, decision)

    @staticmethod
    def _denied(tenant: Tenant, decision: Decision) -> GatewayError:
        metrics.count_denial(tenant.tenant_id, decision.denied)
        retry = decision.retry_after_ms if decision.retry_after_ms >= 0 else None
        return GatewayError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            decision.message(),
            retry_after_ms=retry,
            trailers=denial_metadata(decision),
        )

    async def _serve(
        self, admitted: _Admitted, start: float, labels: _Labels
    ) -> AsyncIterator[Chunk]:
        job = admitted.job
        tenant = admitted.tenant.tenant_id
        first_at: float | None = None
        text: TextStream | None = None
        client_left = False  # cancelled, or its deadline passed
        try:
            text = TextStream(
                job.correlation_id,
                admitted.tokenizer,
                job.stop_strings,
                len(job.prompt_token_ids),
            )
            with stage(job.trace, "gateway.stream"):
                async with contextlib.AsyncExitStack() as scope:
                    if admitted.pending is None:
                        await self._admission_confirmed(admitted, scope)
                    else:  # the lease is heartbeated from the answer on, chunk or not
                        await scope.enter_async_context(self._beside(admitted))
                    relay = await scope.enter_async_context(
                        contextlib.aclosing(self._relay(admitted, text))
                    )
                    async for chunk in relay:
                        labels.version = admitted.progress.model_version or labels.version
                        if first_at is None and chunk.token_ids:
                            first_at = time.perf_counter()
                            metrics.TTFT.labels(tenant, job.model, labels.version).observe(
                                first_at - start
                            )
                            started = admitted.progress.attempt_started_at
                            metrics.OVERHEAD.observe(max(0.0, started - start))
                            if job.trace is not None:
                                job.trace.record("gateway.first_token", start, first_at)
                        yield chunk
        except (asyncio.CancelledError, GeneratorExit):
            client_left = True
            raise
        except GatewayError as e:
            client_left = e.code == grpc.StatusCode.DEADLINE_EXCEEDED
            raise
        finally:
            if text is not None and first_at is not None and len(text.token_ids) > 1:
                metrics.TPOT.labels(job.model, labels.version).observe(
                    (time.perf_counter() - first_at) / (len(text.token_ids) - 1)
                )
            await asyncio.shield(self._settle_after(admitted, text, client_left, labels))

    async def _relay(self, admitted: _Admitted, text: TextStream) -> AsyncGenerator[Chunk, None]:
        """The engine's chunks; none before the admission that runs beside it passed
        (a refusal closes the engine call and is the error, even over the engine's)."""
        confirmed = False  # once, before the first chunk: not on every token's path
        gate = admitted.gate
        dispatched = functools.partial(_open, gate) if gate is not None else None
        chunks = self.dispatcher.run(admitted.job, text, admitted.progress, dispatched)
        try:
            async with contextlib.aclosing(chunks):
                async for chunk in chunks:
                    if not confirmed:
                        await self._confirm(admitted)
                        confirmed = True
                    yield chunk
        except GatewayError:
            await self._confirm(admitted)
            raise

    async def _confirm(self, admitted: _Admitted, *, go: bool = True) -> None:
        """Wait for the admission that runs beside the engine (if any is still in
        flight); raise how it failed. Safe to call from several tasks: the first to see
        it done takes its result. ``go``: the admission may start now even if no engine
        call went out (the stream got its first chunk, failed or ended)."""
        if go and admitted.gate is not None:
            _open(admitted.gate)
        pending = admitted.pending
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
                if pending.done() and admitted.pending is pending:
                    admitted.pending = None
                    self._take_admission(admitted, pending)
        if admitted.error is not None:
            raise admitted.error

    @staticmethod
    def _take_admission(
        admitted: _Admitted, task: asyncio.Task[tuple[Reservation | None, BudgetHold | None]]
    ) -> None:
        if task.cancelled():  # only when the loop shuts down
            admitted.error = GatewayError(
                grpc.StatusCode.UNAVAILABLE, "the gateway stopped during admission; retry"
            )
        elif (error := task.exception()) is not None:
            admitted.error = error
            if isinstance(error, GatewayError):
                metrics.OVERLAP_REFUSALS.inc()
        else:
            admitted.reservation, admitted.budget_hold = task.result()

    @contextlib.asynccontextmanager
    async def _beside(self, admitted: _Admitted) -> AsyncIterator[None]:
        """While the stream runs: once the admission beside the engine answers, what
        follows an admission (the lease heartbeat, the shadow copy)."""
        stop = asyncio.Event()

        async def follow() -> None:
            with contextlib.suppress(Exception):  # the relay reports how it failed
                await self._confirm(admitted, go=False)
            if admitted.error is None and not stop.is_set():  # not for a stream already over
                async with contextlib.AsyncExitStack() as scope:
                    await self._admission_confirmed(admitted, scope)
                    await stop.wait()

        task = asyncio.get_running_loop().create_task(follow(), name="admission-follow")
        try:
            yield
        finally:
            stop.set()
            if admitted.gate is not None:  # the stream is over, engine call or not
                _open(admitted.gate)
            await asyncio.shield(task)  # bounded: the admission has its own timeouts

    async def _admission_confirmed(
        self, admitted: _Admitted, scope: contextlib.AsyncExitStack[bool | None]
    ) -> None:
        """What starts once the request is admitted: the lease heartbeat, the shadow."""
        await scope.enter_async_context(self.limiter.keep_alive(admitted.reservation))
        if admitted.shadow_version and self.shadow is not None:
            self.shadow.mirror(admitted.job, admitted.shadow_version)

    async def _settle_after(
        self, admitted: _Admitted, text: TextStream | None, client_left: bool, labels: _Labels
    ) -> None:
        """Settle, once an admission still in flight has answered (a reservation it
        made is settled like any other; how it failed was recorded)."""
        with contextlib.suppress(Exception):
            await self._confirm(admitted)
        await self._settle(admitted, text, client_left, labels)

    async def _settle(
        self, admitted: _Admitted, text: TextStream | None, client_left: bool, labels: _Labels
    ) -> None:
        """Charge what was used and give back the rest of the reservation.

        The prompt is charged once an engine answered, or once it was sent to an
        engine and the client left (cancel, deadline) before the answer: prefill
        work it started is not free. An engine's refusal or failure charges nothing.
        """
        prompt = 0
        if admitted.error is not None:  # refused while the engine started: work undone
            text = None
        elif text is not None and (
            (progress := admitted.progress).engine_answered or (progress.dispatched and client_left)
        ):
            prompt = text.num_prompt_tokens
        completion = len(text.token_ids) if text is not None else 0
        labels.prompt_tokens, labels.completion_tokens = prompt, completion
        labels.cached_prompt_tokens = min(prompt, text.num_cached_tokens) if text else 0
        tenant = admitted.tenant.tenant_id
        metrics.TOKENS_CHARGED.labels(tenant, "prompt").inc(prompt)
        metrics.TOKENS_CHARGED.labels(tenant, "completion").inc(completion)
        with stage(admitted.job.trace, "gateway.settle"):
            if admitted.reservation is not None:
                await self.limiter.settle(
                    admitted.reservation, prompt_tokens=prompt, completion_tokens=completion
                )
            if admitted.budget_hold is not None and self.budgets is not None:
                await self.budgets.settle(admitted.budget_hold, prompt, completion)
        log.info(
            "request settled",
            prompt_tokens=prompt,
            completion_tokens=completion,
            finish_reason=int(text.finish_reason) if text is not None else 0,
        )

    async def drain(self, grace_s: float) -> None:
        """Refuse new requests; wait up to ``grace_s`` for the ones in flight."""
        self.draining = True
        log.info("draining", in_flight=self.num_in_flight, grace_seconds=grace_s)
        started = time.monotonic()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), grace_s)
        if self.num_in_flight:
            log.warning("drain timed out", in_flight=self.num_in_flight, grace_seconds=grace_s)
        else:
            log.info("drained", seconds=round(time.monotonic() - started, 3))
