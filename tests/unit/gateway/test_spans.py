"""The gateway's request span: the client's trace, stage children, the ids it hands on."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import grpc
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from gateway.domain import CallContext, GatewayError, parent_span_id
from gateway.spans import RequestTrace, end_engine_call, engine_call, stage

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


@pytest.fixture
def exporter() -> Iterator[tuple[TracerProvider, InMemorySpanExporter]]:
    exp = InMemorySpanExporter()
    provider = TracerProvider(shutdown_on_exit=False)
    provider.add_span_processor(SimpleSpanProcessor(exp))
    yield provider, exp
    provider.shutdown()


def parent_id(span: ReadableSpan) -> int:
    assert span.parent is not None
    return span.parent.span_id


def spans_by_name(exp: InMemorySpanExporter) -> dict[str, ReadableSpan]:
    return {s.name: s for s in exp.get_finished_spans()}


def test_request_span_continues_the_clients_trace(
    exporter: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    provider, exp = exporter
    call = CallContext(traceparent=f"00-{TRACE_ID}-{CLIENT_SPAN}-01", request_id="rid-1")
    assert parent_span_id(call.client_traceparent, call.trace_id) == CLIENT_SPAN
    rt = RequestTrace(provider.get_tracer("t"), call, time.perf_counter())
    with stage(rt, "gateway.encode"):
        pass
    with pytest.raises(GatewayError), stage(rt, "gateway.reserve"):
        raise GatewayError(grpc.StatusCode.RESOURCE_EXHAUSTED, "over the limit")
    with stage(rt, "gateway.stream"):
        attempt, header = engine_call(rt, "127.0.0.1:1", "t.abc", 0, call.traceparent)
        end_engine_call(attempt, "", 3)
    rt.finish(grpc.StatusCode.OK, {"llm.tenant_id": "t", "gen_ai.usage.output_tokens": 3})
    spans = spans_by_name(exp)
    root = spans["gateway.request"]
    assert root.kind == SpanKind.SERVER
    assert root.parent is not None
    assert f"{root.parent.span_id:016x}" == CLIENT_SPAN
    assert f"{root.context.trace_id:032x}" == TRACE_ID == call.trace_id
    # what the tokenizer and logs get from now on names the request span
    assert call.traceparent == f"00-{TRACE_ID}-{root.context.span_id:016x}-01"
    for name in ("gateway.encode", "gateway.reserve", "gateway.stream"):
        assert parent_id(spans[name]) == root.context.span_id
    assert spans["gateway.reserve"].status.status_code == StatusCode.ERROR
    assert spans["gateway.reserve"].status.description == "RESOURCE_EXHAUSTED"
    forward = spans["gateway.engine"]
    assert forward.kind == SpanKind.CLIENT
    assert forward.parent is not None
    assert forward.parent.span_id == spans["gateway.stream"].context.span_id
    # the engine is told the attempt's span, not the gateway's request span
    assert header == f"00-{TRACE_ID}-{forward.context.span_id:016x}-01"
    assert (root.attributes or {})["llm.engine_request_id"] == "t.abc"
    assert (root.attributes or {})["rpc.grpc.status_code"] == 0


def test_without_a_client_trace_the_logs_get_the_new_trace_id(
    exporter: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    provider, exp = exporter
    call = CallContext(traceparent="not-a-traceparent")
    assert parent_span_id(call.client_traceparent, call.trace_id) == ""
    rt = RequestTrace(provider.get_tracer("t"), call, time.perf_counter())
    rt.finish(grpc.StatusCode.CANCELLED, {})
    (root,) = exp.get_finished_spans()
    assert root.parent is None
    assert call.trace_id == f"{root.context.trace_id:032x}"
    assert root.status.status_code == StatusCode.ERROR
    assert root.status.description == "CANCELLED"


def test_a_fronts_own_auth_becomes_the_first_stage(
    exporter: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    provider, exp = exporter
    call = CallContext()
    t0 = time.perf_counter()
    call.auth_at = (t0, t0 + 0.002)
    rt = RequestTrace(provider.get_tracer("t"), call, t0 + 0.003)
    rt.finish(grpc.StatusCode.OK, {})
    spans = spans_by_name(exp)
    auth, root = spans["gateway.auth"], spans["gateway.request"]
    assert auth.parent is not None
    assert auth.parent.span_id == root.context.span_id
    assert auth.start_time is not None
    assert auth.end_time is not None
    assert root.start_time is not None
    assert root.start_time <= auth.start_time  # the request starts with its auth
    assert auth.end_time - auth.start_time == pytest.approx(2_000_000, abs=1_000)


def test_a_client_gone_mid_stage_marks_it_cancelled(
    exporter: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    provider, exp = exporter
    rt = RequestTrace(provider.get_tracer("t"), CallContext(), time.perf_counter())

    async def stream() -> None:
        with stage(rt, "gateway.stream"):
            await asyncio.sleep(3600)

    async def main() -> None:
        task = asyncio.create_task(stream())
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    (span,) = exp.get_finished_spans()
    assert span.status.description == "CANCELLED"


def test_tracing_off_stages_are_one_shared_no_op() -> None:
    assert stage(None, "gateway.auth") is stage(None, "gateway.settle")
    assert engine_call(None, "a", "r", 0, "00-x") == (None, "00-x")
    end_engine_call(None, "", 0)  # nothing to end
