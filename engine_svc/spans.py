"""The spans of one engine request, from the timestamps the engine already reports.

    engine.generate    SERVER; parent: the caller's traceparent (the gateway's
                       gateway.engine span), from receipt to the stream's end
      engine.queue     arrival -> first scheduled
      engine.prefill   first scheduled -> first token
      engine.decode    first token -> finished

The engine core stays free of tracing: the phase spans are made afterwards, with
explicit start and end times, from the ``RequestOutput`` timestamps (engine
clock: ``time.monotonic()``) of the last output the servicer saw. A request that
ended early (cancelled, deadline, error) gets the phases it reached, the last
one ending when the stream did. Built only while tracing is on; while OTLP metrics
are on too, the same timestamps make the engine's GenAI server metrics
(``common.genai``: request duration, time to first token, time per output token).
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import grpc
from opentelemetry import trace

from common import genai, tracing
from engine_svc.backends.base import GenerateInput
from engine_svc.core.outputs import RequestOutput
from engine_svc.core.request import FinishReason

PHASES = ("engine.queue", "engine.prefill", "engine.decode")


def _traceparent(metadata: Iterable[tuple[str, str | bytes]]) -> str:
    for key, value in metadata:
        if key == "traceparent":
            return value.decode() if isinstance(value, bytes) else value
    return ""


class EngineTrace:
    """engine.generate and its phases for one Generate call.

    Args:
        tracer: The process's tracer.
        metadata: The call's invocation metadata (its ``traceparent``, if any).
        model: The served model.
    """

    def __init__(
        self, tracer: trace.Tracer, metadata: Iterable[tuple[str, str | bytes]], model: str
    ) -> None:
        self._tracer, self._model = tracer, model
        self.span = tracer.start_span(
            "engine.generate",
            context=tracing.parent_from_traceparent(_traceparent(metadata)),
            kind=trace.SpanKind.SERVER,
            attributes={
                "gen_ai.operation.name": "text_completion",  # token ids in, token ids out
                "gen_ai.request.model": model,
                "gen_ai.response.model": model,
            },
        )
        self.last: RequestOutput | None = None  # the servicer keeps it current

    def request(self, inp: GenerateInput) -> None:
        """What the request is (its engine id, tenant, priority, sizes)."""
        self.span.set_attributes(
            {
                "llm.engine_request_id": inp.request_id,
                "llm.tenant_id": inp.tenant_id,
                "llm.priority": inp.priority,
                "gen_ai.request.max_tokens": inp.sampling_params.max_tokens,
                "gen_ai.request.temperature": inp.sampling_params.temperature,
                "gen_ai.request.top_p": inp.sampling_params.top_p,
                "gen_ai.response.id": inp.request_id,
                "llm.resumed_tokens": len(inp.resumed_output_token_ids),
            }
        )

    def end(self, code: grpc.StatusCode | None) -> None:
        """End the span with the phase spans of the last output; ``code``: the status
        the call was aborted with (None: it returned, or its caller left)."""
        out = self.last
        if code not in (None, grpc.StatusCode.OK):
            failure = code.name
        elif out is None or not out.finished:
            failure = grpc.StatusCode.CANCELLED.name  # the caller left first
        else:
            failure = "ERROR" if out.finish_reason == FinishReason.ERROR else ""
        if out is not None:
            self._phases(out)
            self._record_metrics(out, failure)
            self.span.set_attributes(
                {
                    "gen_ai.usage.input_tokens": out.num_prompt_tokens,
                    "gen_ai.usage.output_tokens": out.num_output_tokens,
                    "llm.cached_prompt_tokens": out.num_cached_tokens,
                    "llm.preemptions": out.num_preemptions,
                    "llm.finish_reason": str(out.finish_reason or ""),
                }
            )
            if out.finish_reason is not None:
                self.span.set_attribute("gen_ai.response.finish_reasons", [str(out.finish_reason)])
        if failure:
            tracing.end_with_error(self.span, failure)
        else:
            self.span.end()

    def _phases(self, out: RequestOutput) -> None:
        now = time.monotonic()
        wall = tracing.wall_clock(now)
        stop = out.finished_time if out.finished and out.finished_time is not None else now
        context = trace.set_span_in_context(self.span)
        marks = (out.arrival_time, out.first_scheduled_time, out.first_token_time, None)
        for i, name in enumerate(PHASES):
            start, end = marks[i], marks[i + 1]
            if start is None:  # not reached
                return
            span = self._tracer.start_span(name, context=context, start_time=wall(start))
            span.end(end_time=wall(stop if end is None else end))

    def _record_metrics(self, out: RequestOutput, failure: str) -> None:
        instruments = genai.instruments(tracing.meter())
        if instruments is None:
            return
        common = {
            genai.OPERATION: "text_completion",
            genai.REQUEST_MODEL: self._model,
            genai.RESPONSE_MODEL: self._model,
        }
        end = out.finished_time if out.finished_time is not None else time.monotonic()
        failed = {genai.ERROR_TYPE: failure} if failure else {}
        instruments.request_duration.record(end - out.arrival_time, {**common, **failed})
        first = out.first_token_time
        if failure or first is None:
            return
        instruments.time_to_first_token.record(first - out.arrival_time, common)
        generated = out.num_output_tokens - out.num_resumed_tokens
        if generated > 1:
            instruments.time_per_output_token.record((end - first) / (generated - 1), common)
