"""The spans of one gateway request (docs/operations.md, "Tracing").

    gateway.request            SERVER; parent: the client's traceparent (none: a new trace)
      gateway.auth             the API key (the HTTP front's, before the body, too)
      gateway.reserve          Redis: request unit + lease (and the tokens on the one-call path)
      gateway.encode           the tokenizer
      gateway.route            model route fit, max_tokens, version routing
      gateway.take             Redis: the tokens (two-call path)
      gateway.budget           tenant budgets (when the tenant or key has any)
      gateway.first_token      request start -> first token (the TTFT metric's interval)
      gateway.stream           the engine attempts, to the last chunk
        gateway.engine         CLIENT, one per attempt; its traceparent goes to the engine,
                               whose engine.generate (queue, prefill, decode) hangs below
      gateway.settle           Redis: refund, release the lease, budgets

A ``RequestTrace`` (the ``gateway.domain.Trace`` of a call) exists only while tracing
is on (``common.tracing.tracer()``); the pipeline tests ``call.trace`` and does nothing
else when it is None. Attributes are ids, names and counts: never the API key, the
prompt or the output text. They follow OpenTelemetry's GenAI conventions where one
applies (``gen_ai.operation.name``, ``gen_ai.request.*``, ``gen_ai.response.id`` and
``.model``, ``gen_ai.usage.*``); the finish reason is on the engine's span.

While OTLP metrics are on too, the request's end records the GenAI metrics
(``common.genai``): the gateway serves its clients (``gen_ai.server.request.duration``,
``gen_ai.server.time_to_first_token``, ``gen_ai.server.time_per_output_token``) and is
a client of the engines (``gen_ai.client.token.usage``: the tokens they reported).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import grpc
from opentelemetry import trace

from common import genai, tracing
from gateway.domain import GatewayError, Trace, parent_span_id

if TYPE_CHECKING:
    from gateway.domain import CallContext
    from llm.v1 import gateway_pb2

FIRST_TOKEN = "gateway.first_token"

_NO_SPAN: contextlib.nullcontext[None] = contextlib.nullcontext()


def _failure(e: BaseException) -> str:
    if isinstance(e, GatewayError):
        return e.code.name
    if isinstance(e, asyncio.CancelledError | GeneratorExit):
        return grpc.StatusCode.CANCELLED.name
    return type(e).__name__


class RequestTrace:
    """The request span and its stage spans (explicit parents; none is made current).

    Args:
        tracer: The process's tracer.
        call: The call; its ``trace_id``/``traceparent`` become the request span's, so
            logs, the tokenizer and the engines see the ids of this trace.
        started: ``time.perf_counter()`` at the pipeline's start (an earlier
            ``call.auth_at`` moves the request's start back to it).
        request: What the client asked for (its parameters become ``gen_ai.request.*``).
    """

    def __init__(
        self,
        tracer: trace.Tracer,
        call: CallContext,
        started: float,
        request: gateway_pb2.GenerateRequest | None = None,
    ) -> None:
        self._tracer = tracer
        self._wall = tracing.wall_clock(time.perf_counter())  # perf_counter -> unix ns
        client_span = parent_span_id(call.client_traceparent, call.trace_id)
        parent = tracing.remote_parent(call.trace_id, client_span, call.traceparent[-2:])
        if call.auth_at is not None:
            started = min(started, call.auth_at[0])
        self._started, self._first_token_at = started, 0.0
        self._operation = "chat"
        attributes: dict[str, str | int | float] = {"llm.request_id": call.request_id}
        if call.request_id:
            attributes["gen_ai.response.id"] = call.request_id  # what the responses carry
        if request is not None:
            attributes.update(request_attributes(request))
            self._operation = str(attributes[genai.OPERATION])
        self.span = tracer.start_span(
            "gateway.request",
            context=parent,
            kind=trace.SpanKind.SERVER,
            start_time=self._wall(started),
            attributes=attributes,
        )
        self._context = trace.set_span_in_context(self.span)
        self._open: trace.Span | None = None  # the stage whose children engine calls are
        call.trace_id = tracing.trace_id(self.span)
        call.traceparent = tracing.traceparent(self.span)
        if call.auth_at is not None:  # the front authenticated before the pipeline ran
            self.record("gateway.auth", *call.auth_at)
        if call.tenant is not None:
            self.span.set_attribute("llm.tenant_id", call.tenant.tenant_id)

    def record(self, name: str, start: float, end: float) -> None:
        """A finished child span between two ``time.perf_counter()`` readings."""
        span = self._tracer.start_span(name, context=self._context, start_time=self._wall(start))
        span.end(end_time=self._wall(end))
        if name == FIRST_TOKEN:
            self._first_token_at = end

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[trace.Span]:
        """A child span around a block; an exception marks it failed (its status name)."""
        span = self._tracer.start_span(name, context=self._context)
        outer, self._open = self._open, span
        try:
            yield span
        except BaseException as e:
            span.set_status(trace.Status(trace.StatusCode.ERROR, _failure(e)))
            raise
        finally:
            self._open = outer
            span.end()

    def engine_call(self, replica: str, request_id: str, resumed_tokens: int) -> trace.Span:
        """The CLIENT span of one engine attempt (under the open stage: the stream);
        ``resumed_tokens``: the output a failover hands on (0 on a first attempt)."""
        self.span.set_attribute("llm.engine_request_id", request_id)
        parent = trace.set_span_in_context(self._open) if self._open else self._context
        return self._tracer.start_span(
            "gateway.engine",
            context=parent,
            kind=trace.SpanKind.CLIENT,
            attributes={
                "llm.engine.address": replica,
                "llm.engine_request_id": request_id,
                "llm.resumed_tokens": resumed_tokens,
            },
        )

    def finish(self, code: grpc.StatusCode, attributes: dict[str, str | int]) -> None:
        """End the request span with its final status and what it used (and record the
        GenAI metrics while OTLP metrics are on)."""
        self.span.set_attributes({k: v for k, v in attributes.items() if v != ""})
        model = attributes.get(genai.REQUEST_MODEL, "")
        if model:
            self.span.set_attribute(genai.RESPONSE_MODEL, model)
        self.span.set_attribute("rpc.grpc.status_code", code.value[0])
        self._record_metrics(code, str(model), attributes)
        if code != grpc.StatusCode.OK:
            tracing.end_with_error(self.span, code.name)
        else:
            self.span.end()

    def _record_metrics(
        self, code: grpc.StatusCode, model: str, attributes: dict[str, str | int]
    ) -> None:
        instruments = genai.instruments(tracing.meter())
        if instruments is None:
            return
        now = time.perf_counter()
        common: dict[str, str] = {genai.OPERATION: self._operation}
        if model:
            common[genai.REQUEST_MODEL] = model
            common[genai.RESPONSE_MODEL] = model
        failed = {genai.ERROR_TYPE: code.name} if code != grpc.StatusCode.OK else {}
        instruments.request_duration.record(now - self._started, {**common, **failed})
        output = int(attributes.get("gen_ai.usage.output_tokens", 0))
        if not failed and self._first_token_at:
            first = self._first_token_at
            instruments.time_to_first_token.record(first - self._started, common)
            if output > 1:
                instruments.time_per_output_token.record(
                    max(0.0, now - first) / (output - 1), common
                )
        if model:  # the engines answered: what they counted
            usage = {"input": int(attributes.get("gen_ai.usage.input_tokens", 0)), "output": output}
            for kind, value in usage.items():
                instruments.token_usage.record(value, {**common, genai.TOKEN_TYPE: kind})


def request_attributes(request: gateway_pb2.GenerateRequest) -> dict[str, str | int | float]:
    """The GenAI attributes of what the client asked: operation, model and the sampling
    parameters it set (0 = unset for max_tokens and top_p)."""
    sampling = request.sampling
    out: dict[str, str | int | float] = {
        genai.OPERATION: "chat" if request.HasField("messages") else "text_completion",
        "gen_ai.request.temperature": round(sampling.temperature, 6),
    }
    if request.model:
        out[genai.REQUEST_MODEL] = request.model
    if sampling.max_tokens:
        out["gen_ai.request.max_tokens"] = sampling.max_tokens
    if sampling.top_p:
        out["gen_ai.request.top_p"] = round(sampling.top_p, 6)
    if request.n > 1:
        out["gen_ai.request.choice.count"] = request.n
    return out


def stage(rt: Trace | None, name: str) -> contextlib.AbstractContextManager[object]:
    """``rt.stage(name)``, or a shared no-op while tracing is off."""
    return _NO_SPAN if rt is None else rt.stage(name)


def engine_call(
    rt: Trace | None, replica: str, request_id: str, resumed_tokens: int, traceparent: str
) -> tuple[trace.Span | None, str]:
    """An engine attempt's span and the traceparent to send it (while tracing is off:
    no span, and ``traceparent``, the call's, as it is)."""
    if rt is None:
        return None, traceparent
    span = rt.engine_call(replica, request_id, resumed_tokens)
    return span, tracing.traceparent(span)


def end_engine_call(span: trace.Span | None, failure: str, num_tokens: int) -> None:
    """End an attempt's span: ``failure`` is a status name ("" = it finished)."""
    if span is None:
        return
    span.set_attribute("gen_ai.usage.output_tokens", num_tokens)
    if failure:
        tracing.end_with_error(span, failure)
    else:
        span.end()
