"""The request pipeline: one object every front calls (docs/architecture.md).

    auth ─► model, params ─► reserve ─► encode ─► context ─► version ─► take ─► budget ─► engine
    (bearer) (ModelInfo)     (Redis: 1   (tokenizer) (length)  (routing   (Redis:  (Redis,   (route,
                             request,                          policy,    tokens)  if the    retry,
                             1 lease)                          shadow)             tenant    fail-
                                                                                   has any)  over)
                             └── settle exactly once on every ending: done, error, cancel ──┘

Admission (reserve, take, budgets, the overlapped admission, confirm, settle) is
``gateway.request.admission``, the engine job of a counted prompt (route target, max_tokens,
version) ``gateway.request.job``, the outcome's usage record and trace attributes
``gateway.request.outcome``, and the in-flight count with the drain
``gateway.request.in_flight``; this module orders the steps around them.

The model step resolves model routes (``gateway.request.models``): an alias or
fallback chain picks its first target with a ready replica there, and moves on
at the context step when the counted prompt and the requested output do not fit
that target; the dispatcher moves on to the next one when that target is at
capacity or fails before the first token.

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
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

import grpc
import structlog

from common import tracing
from common.log import get_logger
from gateway import metrics, pricing
from gateway.config import GatewayConfig
from gateway.domain import CallContext, Chunk, Deadline, GatewayError
from gateway.fleet.dispatcher import AttemptProgress, Dispatcher, EngineJob
from gateway.fleet.replica_pool import ModelEntry, ReplicaPool
from gateway.fleet.tokenizers import TokenizerSet
from gateway.release.shadow import ShadowMirror
from gateway.release.version_router import VersionRouter
from gateway.request.admission import Admission, AdmissionTicket
from gateway.request.authenticate import Authenticator
from gateway.request.budgets import BudgetGate
from gateway.request.detokenize import TextStream
from gateway.request.encode import Encoder, check_prompt_size
from gateway.request.in_flight import InFlight
from gateway.request.job import JobBuilder
from gateway.request.models import ModelChooser
from gateway.request.outcome import Outcome
from gateway.request.params import request_priority, validate_sampling, validate_stop_token_ids
from gateway.request.samples import merged
from gateway.request.tools import OutputPlan, OutputShaper, plan_output
from gateway.spans import RequestTrace, stage
from llm.v1 import gateway_pb2
from ratelimit.budget.policy import PriceTable
from ratelimit.config import Tenant
from ratelimit.limiter.rate_limiter import RateLimiter
from ratelimit.usage.records import UsageLog
from tokenizer_svc.tokenizer import TextTokenizer

log = get_logger(__name__)


@dataclass(slots=True)
class _Admitted:
    job: EngineJob
    ticket: AdmissionTicket
    tokenizer: TextTokenizer
    shadow_version: str = ""
    plan: OutputPlan = field(default_factory=OutputPlan)  # tool calls, reasoning
    progress: AttemptProgress = field(default_factory=AttemptProgress)  # the engine attempts'


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
        self.pool = pool
        self.dispatcher = dispatcher
        self.router = router
        self.shadow = shadow
        self.models = models or ModelChooser(pool)
        self.admission = Admission(limiter, budgets, overlap=config.overlap_admission)
        self.usage = usage
        self.prices = prices or PriceTable()
        self.jobs = JobBuilder(router, config.default_max_tokens, config.max_max_tokens)
        self.in_flight = InFlight()

    async def list_models(self, call: CallContext) -> list[ModelEntry]:
        """Models the caller's tenant may use, with versions and replica counts."""
        tenant = await self.auth.tenant(call)
        entries = await self.models.with_routes(self.pool.catalog())
        entries = [e for e in entries if tenant.allows_model(e.model)]
        return await self.router.annotate(entries) if self.router is not None else entries

    def generate(
        self, request: gateway_pb2.GenerateRequest, call: CallContext
    ) -> AsyncGenerator[Chunk, None]:
        """Stream one completion (``n`` > 1: its samples, merged; ``Chunk.index`` names
        each); see the module docstring for the contract.

        Raises:
            GatewayError: with the status code and message for the caller.
        """
        if request.n > 1:
            return self._samples(request, call)
        return self._generate_one(request, call)

    async def _samples(
        self, request: gateway_pb2.GenerateRequest, call: CallContext
    ) -> AsyncGenerator[Chunk, None]:
        if request.n > self.config.max_n:
            raise GatewayError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"n is {request.n}; this gateway serves at most {self.config.max_n} "
                "samples per request ([gateway] max_n)",
            )
        async with contextlib.aclosing(merged(self._generate_one, request, call)) as chunks:
            async for chunk in chunks:
                yield chunk

    async def _generate_one(
        self, request: gateway_pb2.GenerateRequest, call: CallContext
    ) -> AsyncGenerator[Chunk, None]:
        start = time.perf_counter()
        tenant_label, code = "unauthenticated", grpc.StatusCode.OK
        tenant_id = ""  # set once authenticated: then the request is recorded
        outcome = Outcome()
        if (tracer := tracing.tracer()) is not None:
            call.trace = RequestTrace(tracer, call, start, request)  # its trace id: the logs'
        structlog.contextvars.bind_contextvars(request_id=call.request_id, trace_id=call.trace_id)
        try:
            self.in_flight.enter()
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
            outcome.model, outcome.version = admitted.job.model, admitted.job.model_version
            # closed here, not by the garbage collector, when the caller closes this stream:
            # the engine call is cancelled and the request settled before the usage below
            shaper = OutputShaper(admitted.plan) if admitted.plan.active else None
            async with contextlib.aclosing(self._serve(admitted, start, outcome)) as chunks:
                async for chunk in chunks:
                    yield chunk if shaper is None else shaper.apply(chunk)
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
            self.in_flight.leave()
            model, version = outcome.model, outcome.version
            metrics.child(metrics.REQUESTS, tenant_label, code.name, model, version).inc()
            metrics.child(metrics.E2E, model, version).observe(time.perf_counter() - start)
            pricing.count_spend(
                self.prices, tenant_id, model, outcome.prompt_tokens, outcome.completion_tokens
            )
            if tenant_id and self.usage is not None:
                self.usage.record(outcome.usage_event(tenant_id, call.key_id, code, self.prices))
            if call.trace is not None:
                call.trace.finish(code, outcome.span_attributes(tenant_id))

    async def _admit(
        self, request: gateway_pb2.GenerateRequest, call: CallContext, tenant: Tenant
    ) -> _Admitted:
        name = request.model or self.pool.default_model()
        choice = await self.models.choose(name, request.model_version)
        # the permission first: a name outside the tenant's list is refused the same way
        # whether or not it is served (no oracle of other tenants' models)
        self.auth.check_model(tenant, name)  # a route's targets are reached by its name
        if not choice.candidates:
            raise self.models.unknown(name, request.model_version, choice, tenant.allows_model)
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
        self.admission.refuse_known_denial(tenant, call)  # before any tokenizer or Redis call
        # a prompt no context could hold is refused before it spends a request unit
        check_prompt_size(request, choice.max_context_length)
        tokenizer = self.tokenizers.get(info)
        if tokenizer is None:
            raise GatewayError(
                grpc.StatusCode.UNAVAILABLE,
                f"model {choice.model!r} has no ready replica yet (its tokenizer is not "
                "loaded); retry shortly",
            )
        plan = self._plan(request, choice.model, tokenizer)
        ticket = await self.admission.start(tenant, call)
        try:
            t1 = time.perf_counter()
            with stage(call.trace, "gateway.encode"):
                prompt_ids = await self.encoder.encode(request, call, deadline, tokenizer)
            t2 = time.perf_counter()
            metrics.STAGE_ENCODE.observe(t2 - t1)
            job, shadow_version = await self.jobs.build(
                request, call, tenant, choice, prompt_ids, deadline, priority
            )
            if plan.guided is not None:  # the tool choice's constraint
                job.sampling.guided.CopyFrom(plan.guided)
            metrics.STAGE_ROUTE.observe(time.perf_counter() - t2)
            max_tokens = job.sampling.max_tokens
            await self.admission.take(ticket, len(prompt_ids) + max_tokens, call)
        except BaseException:
            await self.admission.abandon(ticket, call)  # nothing was served
            raise
        await self.admission.finish(ticket, job, max_tokens, call)
        return _Admitted(job, ticket, tokenizer, shadow_version, plan)

    def _plan(
        self, request: gateway_pb2.GenerateRequest, model: str, tokenizer: TextTokenizer
    ) -> OutputPlan:
        """How the output is read (tool calls, reasoning), and the constraint of a tool
        choice; before any request unit is spent.

        Raises:
            GatewayError: INVALID_ARGUMENT naming the field.
        """
        cfg = self.config
        if request.tools and request.WhichOneof("input") != "messages":
            raise GatewayError(
                grpc.StatusCode.INVALID_ARGUMENT, "tools need chat messages, not a prompt"
            )
        template = tokenizer.chat_template
        try:
            return plan_output(
                request,
                template.source if template is not None else "",
                tool_parser=cfg.parser_of(cfg.tool_parsers, model),
                reasoning=cfg.parser_of(cfg.reasoning_parsers, model),
                max_guided_chars=cfg.max_guided_chars,
            )
        except ValueError as e:
            raise GatewayError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None

    async def _serve(
        self, admitted: _Admitted, start: float, outcome: Outcome
    ) -> AsyncGenerator[Chunk, None]:
        job, ticket, progress = admitted.job, admitted.ticket, admitted.progress
        tenant = ticket.tenant.tenant_id
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
            chunks = self.dispatcher.run(job, text, progress, ticket.on_dispatched)
            with stage(job.trace, "gateway.stream"):
                async with (
                    self.admission.held(ticket, lambda: self._mirror(admitted)),
                    contextlib.aclosing(self.admission.confirmed(ticket, chunks)) as relay,
                ):
                    async for chunk in relay:
                        outcome.version = progress.model_version or outcome.version
                        outcome.model = progress.model or outcome.model
                        if first_at is None and chunk.token_ids:
                            first_at = time.perf_counter()
                            metrics.child(metrics.TTFT, tenant, job.model, outcome.version).observe(
                                first_at - start
                            )
                            started = progress.attempt_started_at
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
                metrics.child(metrics.TPOT, job.model, outcome.version).observe(
                    (time.perf_counter() - first_at) / (len(text.token_ids) - 1)
                )
            charge = await asyncio.shield(
                self.admission.settle(ticket, text, progress, client_left, job.trace)
            )
            outcome.prompt_tokens = charge.prompt_tokens
            outcome.cached_prompt_tokens = charge.cached_prompt_tokens
            outcome.completion_tokens = charge.completion_tokens

    def _mirror(self, admitted: _Admitted) -> None:
        """Once the request is admitted: its shadow copy, if the routing policy asks."""
        if admitted.shadow_version and self.shadow is not None:
            self.shadow.mirror(admitted.job, admitted.shadow_version)

    async def drain(self, grace_s: float) -> None:
        """Refuse new requests; wait up to ``grace_s`` for the ones in flight."""
        await self.in_flight.drain(grace_s)

    @property
    def draining(self) -> bool:
        """True once ``drain`` began: new requests are refused."""
        return self.in_flight.draining

    @property
    def num_in_flight(self) -> int:
        """Requests being served."""
        return self.in_flight.count
