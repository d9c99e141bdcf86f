"""The request span's GenAI attributes and the GenAI metrics recorded at its end
(OpenTelemetry's GenAI semantic conventions), read from in-memory exporters."""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from common import tracing
from gateway.domain import CallContext
from gateway.spans import FIRST_TOKEN, RequestTrace
from llm.v1 import common_pb2, gateway_pb2
from tests.support.otel import points


@pytest.fixture
def otel() -> Iterator[tuple[TracerProvider, InMemorySpanExporter, InMemoryMetricReader]]:
    exp, reader = InMemorySpanExporter(), InMemoryMetricReader()
    provider = TracerProvider(shutdown_on_exit=False)
    provider.add_span_processor(SimpleSpanProcessor(exp))
    tracing.use_meter_provider(MeterProvider(metric_readers=[reader], shutdown_on_exit=False))
    yield provider, exp, reader
    tracing.shutdown()
    provider.shutdown()


def chat_request() -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        model="smol",
        messages=common_pb2.ChatMessages(messages=[common_pb2.ChatMessage(role="user")]),
        sampling=common_pb2.SamplingParams(max_tokens=16, temperature=0.5, top_p=0.9),
    )


def run_request(
    provider: TracerProvider, request: gateway_pb2.GenerateRequest, code: grpc.StatusCode
) -> None:
    start = time.perf_counter() - 1.0  # began a second ago: its first token came at 20 ms
    rt = RequestTrace(provider.get_tracer("t"), CallContext(request_id="rid-9"), start, request)
    if code == grpc.StatusCode.OK:
        rt.record(FIRST_TOKEN, start, start + 0.02)
    rt.finish(
        code,
        {
            "gen_ai.request.model": "smol" if code == grpc.StatusCode.OK else "",
            "gen_ai.usage.input_tokens": 12,
            "gen_ai.usage.output_tokens": 5,
        },
    )


def test_the_request_span_carries_genai_attributes(
    otel: tuple[TracerProvider, InMemorySpanExporter, InMemoryMetricReader],
) -> None:
    provider, exp, _ = otel
    run_request(provider, chat_request(), grpc.StatusCode.OK)
    (root,) = [s for s in exp.get_finished_spans() if s.name == "gateway.request"]
    attrs = dict(root.attributes or {})
    assert attrs["gen_ai.operation.name"] == "chat"
    assert attrs["gen_ai.request.model"] == "smol"
    assert attrs["gen_ai.response.model"] == "smol"
    assert attrs["gen_ai.request.max_tokens"] == 16
    assert attrs["gen_ai.request.temperature"] == 0.5
    assert attrs["gen_ai.request.top_p"] == pytest.approx(0.9)
    assert attrs["gen_ai.response.id"] == "rid-9"
    assert attrs["gen_ai.usage.input_tokens"] == 12


def test_a_prompt_is_a_text_completion() -> None:
    from gateway.spans import request_attributes

    attrs = request_attributes(gateway_pb2.GenerateRequest(prompt="Once"))
    assert attrs["gen_ai.operation.name"] == "text_completion"
    assert "gen_ai.request.max_tokens" not in attrs  # unset: not claimed


def test_a_request_records_the_server_and_client_metrics(
    otel: tuple[TracerProvider, InMemorySpanExporter, InMemoryMetricReader],
) -> None:
    provider, _, reader = otel
    run_request(provider, chat_request(), grpc.StatusCode.OK)
    got = points(reader)
    (duration,) = got["gen_ai.server.request.duration"]
    assert duration.count == 1
    assert duration.attributes["gen_ai.operation.name"] == "chat"
    assert duration.attributes["gen_ai.request.model"] == "smol"
    assert "error.type" not in duration.attributes
    (ttft,) = got["gen_ai.server.time_to_first_token"]
    assert ttft.sum == pytest.approx(0.02)
    assert ttft.explicit_bounds[0] == 0.001  # the conventions' advisory buckets
    (tpot,) = got["gen_ai.server.time_per_output_token"]
    assert tpot.count == 1
    usage = {p.attributes["gen_ai.token.type"]: p.sum for p in got["gen_ai.client.token.usage"]}
    assert usage == {"input": 12, "output": 5}


def test_a_failed_request_has_an_error_type_and_no_token_timings(
    otel: tuple[TracerProvider, InMemorySpanExporter, InMemoryMetricReader],
) -> None:
    provider, _, reader = otel
    run_request(provider, chat_request(), grpc.StatusCode.RESOURCE_EXHAUSTED)
    got = points(reader)
    (duration,) = got["gen_ai.server.request.duration"]
    assert duration.attributes["error.type"] == "RESOURCE_EXHAUSTED"
    assert "gen_ai.server.time_to_first_token" not in got
    assert "gen_ai.client.token.usage" not in got  # never reached an engine


def test_no_meter_no_metrics(
    otel: tuple[TracerProvider, InMemorySpanExporter, InMemoryMetricReader],
) -> None:
    provider, exp, reader = otel
    tracing.use_meter_provider(None)
    run_request(provider, chat_request(), grpc.StatusCode.OK)
    assert exp.get_finished_spans()
    assert not points(reader)
