"""Engine spans: engine.generate under the caller's traceparent, its queue / prefill /
decode phases from the timestamps of the engine's outputs, and nothing while tracing
is off. A scripted backend (chosen timestamps) behind the real servicer on loopback gRPC.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator

import grpc
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from common import tracing
from engine_svc import service
from engine_svc.backends.base import GenerateInput, QueueFullError
from engine_svc.core.outputs import ModelInfo, RequestOutput
from engine_svc.core.request import FinishReason
from engine_svc.service import EngineServicer
from engine_svc.stats import BackendStats
from llm.v1 import engine_pb2, engine_pb2_grpc

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_SPAN}-01"
# engine-clock offsets (seconds before the last output) of arrival, first scheduled,
# first token and finish
QUEUE_S, PREFILL_S, DECODE_S = 0.250, 0.125, 0.0625


class ScriptedBackend:
    """Streams two tokens whose outputs carry chosen timestamps, or refuses (``full``)."""

    name = "scripted"

    def __init__(self, mode: str = "ok") -> None:
        self.mode = mode

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def generate(self, inp: GenerateInput) -> AsyncIterator[RequestOutput]:
        if self.mode == "full":
            raise QueueFullError("the waiting queue is full", retry_after_ms=250)
        finished = time.monotonic()
        first_token = finished - DECODE_S
        scheduled = first_token - PREFILL_S
        arrival = scheduled - QUEUE_S
        common = {
            "num_prompt_tokens": len(inp.prompt_token_ids),
            "num_cached_tokens": 0,
            "arrival_time": arrival,
            "first_scheduled_time": scheduled,
            "first_token_time": first_token,
        }
        yield RequestOutput(inp.request_id, [7], num_output_tokens=1, **common)  # type: ignore[arg-type]
        yield RequestOutput(
            inp.request_id,
            [8],
            finished=True,
            finish_reason=FinishReason.LENGTH,
            num_output_tokens=2,
            finished_time=finished,
            **common,  # type: ignore[arg-type]
        )

    async def abort(self, request_id: str) -> None: ...

    def stats(self) -> BackendStats:
        raise AssertionError("not needed here")

    def model_info(self) -> ModelInfo:
        return ModelInfo(model="m", max_context_length=64, vocab_size=100)


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    exp = InMemorySpanExporter()
    provider = TracerProvider(shutdown_on_exit=False)
    provider.add_span_processor(SimpleSpanProcessor(exp))
    tracing.use_provider(provider)
    try:
        yield exp
    finally:
        tracing.use_provider(None)
        provider.shutdown()


def generate(
    backend: ScriptedBackend, metadata: tuple[tuple[str, str], ...] = ()
) -> grpc.StatusCode:
    """One Generate call on the real servicer over loopback; its final status."""

    async def main() -> grpc.StatusCode:
        server = grpc.aio.server()
        servicer = EngineServicer(backend, model_name="m", version="v", config_hash="h", build="b")  # type: ignore[arg-type]
        engine_pb2_grpc.add_EngineServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                req = engine_pb2.EngineGenerateRequest(
                    request_id="tenant-a.0123",
                    tenant_id="tenant-a",
                    prompt_token_ids=[1, 2, 3],
                    sampling=engine_pb2.EngineSamplingParams(max_tokens=2),
                )
                call = engine_pb2_grpc.EngineStub(ch).Generate(req, timeout=10, metadata=metadata)
                try:
                    async for _ in call:
                        pass
                except grpc.aio.AioRpcError as e:
                    return e.code()
                return grpc.StatusCode.OK
        finally:
            await server.stop(None)

    return asyncio.run(main())


def by_name(spans: tuple[ReadableSpan, ...]) -> dict[str, ReadableSpan]:
    out = {s.name: s for s in spans}
    assert len(out) == len(spans), [s.name for s in spans]
    return out


def parent_id(span: ReadableSpan) -> int:
    assert span.parent is not None
    return span.parent.span_id


def seconds(span: ReadableSpan) -> float:
    assert span.start_time is not None
    assert span.end_time is not None
    return (span.end_time - span.start_time) / 1e9


def test_engine_spans_join_the_callers_trace(exporter: InMemorySpanExporter) -> None:
    code = generate(ScriptedBackend(), (("traceparent", TRACEPARENT),))
    assert code == grpc.StatusCode.OK
    spans = by_name(exporter.get_finished_spans())
    assert set(spans) == {"engine.generate", "engine.queue", "engine.prefill", "engine.decode"}
    root = spans["engine.generate"]
    assert root.kind == SpanKind.SERVER
    assert root.parent is not None
    assert root.parent.is_remote
    assert (f"{root.context.trace_id:032x}", f"{root.parent.span_id:016x}") == (
        TRACE_ID,
        PARENT_SPAN,
    )
    assert root.status.status_code == StatusCode.UNSET
    attrs = dict(root.attributes or {})
    assert attrs["llm.engine_request_id"] == "tenant-a.0123"
    assert attrs["llm.tenant_id"] == "tenant-a"
    assert attrs["gen_ai.request.model"] == "m"
    assert attrs["gen_ai.usage.input_tokens"] == 3
    assert attrs["gen_ai.usage.output_tokens"] == 2
    assert attrs["llm.finish_reason"] == str(FinishReason.LENGTH)
    for name in ("engine.queue", "engine.prefill", "engine.decode"):
        assert parent_id(spans[name]) == root.context.span_id
        assert spans[name].context.trace_id == root.context.trace_id
    # the phases are the intervals between the outputs' engine-clock timestamps
    assert seconds(spans["engine.queue"]) == pytest.approx(QUEUE_S, abs=1e-6)
    assert seconds(spans["engine.prefill"]) == pytest.approx(PREFILL_S, abs=1e-6)
    assert seconds(spans["engine.decode"]) == pytest.approx(DECODE_S, abs=1e-6)
    queue, prefill, decode = (spans[n] for n in ("engine.queue", "engine.prefill", "engine.decode"))
    assert queue.end_time == prefill.start_time
    assert prefill.end_time == decode.start_time


def test_a_refusal_is_a_failed_span_without_phases(exporter: InMemorySpanExporter) -> None:
    code = generate(ScriptedBackend("full"), (("traceparent", TRACEPARENT),))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    (span,) = exporter.get_finished_spans()
    assert span.name == "engine.generate"
    assert span.status.status_code == StatusCode.ERROR
    assert span.status.description == "RESOURCE_EXHAUSTED"


def test_without_a_traceparent_the_engine_starts_a_trace(exporter: InMemorySpanExporter) -> None:
    assert generate(ScriptedBackend()) == grpc.StatusCode.OK
    root = by_name(exporter.get_finished_spans())["engine.generate"]
    assert root.parent is None


def test_tracing_off_builds_no_span(monkeypatch: pytest.MonkeyPatch) -> None:
    tracing.use_provider(None)

    def no_trace(*args: object, **kwargs: object) -> None:
        raise AssertionError("a span was built while tracing is off")

    monkeypatch.setattr(service, "EngineTrace", no_trace)
    assert generate(ScriptedBackend(), (("traceparent", TRACEPARENT),)) == grpc.StatusCode.OK
