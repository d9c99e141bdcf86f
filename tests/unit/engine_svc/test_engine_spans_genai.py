"""The engine's span in OpenTelemetry's GenAI conventions, and its GenAI server metrics
from the outputs' own timestamps (the scripted backend of test_engine_spans)."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from common import tracing
from tests.support.otel import points
from tests.unit.engine_svc.test_engine_spans import (
    DECODE_S,
    PREFILL_S,
    QUEUE_S,
    ScriptedBackend,
    by_name,
    exporter,  # noqa: F401 (the fixture)
    generate,
)


@pytest.fixture
def reader() -> Iterator[InMemoryMetricReader]:
    got = InMemoryMetricReader()
    tracing.use_meter_provider(MeterProvider(metric_readers=[got], shutdown_on_exit=False))
    try:
        yield got
    finally:
        tracing.use_meter_provider(None)


def test_the_engine_span_has_genai_attributes(exporter: InMemorySpanExporter) -> None:  # noqa: F811
    assert generate(ScriptedBackend()) == grpc.StatusCode.OK
    attrs = dict(by_name(exporter.get_finished_spans())["engine.generate"].attributes or {})
    assert attrs["gen_ai.operation.name"] == "text_completion"
    assert attrs["gen_ai.response.model"] == "m"
    assert attrs["gen_ai.response.id"] == "tenant-a.0123"
    assert attrs["gen_ai.request.max_tokens"] == 2
    assert "gen_ai.request.temperature" in attrs
    assert tuple(attrs["gen_ai.response.finish_reasons"]) == ("length",)  # type: ignore[arg-type]


def test_the_engine_records_genai_server_metrics(
    exporter: InMemorySpanExporter,  # noqa: F811
    reader: InMemoryMetricReader,
) -> None:
    assert generate(ScriptedBackend()) == grpc.StatusCode.OK
    got = points(reader)
    (duration,) = got["gen_ai.server.request.duration"]
    assert duration.sum == pytest.approx(QUEUE_S + PREFILL_S + DECODE_S, abs=1e-6)
    assert duration.attributes["gen_ai.operation.name"] == "text_completion"
    assert duration.attributes["gen_ai.request.model"] == "m"
    (ttft,) = got["gen_ai.server.time_to_first_token"]
    assert ttft.sum == pytest.approx(QUEUE_S + PREFILL_S, abs=1e-6)
    (tpot,) = got["gen_ai.server.time_per_output_token"]
    assert tpot.sum == pytest.approx(DECODE_S, abs=1e-6)  # two tokens: one gap


def test_a_refusal_records_no_timings(
    exporter: InMemorySpanExporter,  # noqa: F811
    reader: InMemoryMetricReader,
) -> None:
    assert generate(ScriptedBackend("full")) == grpc.StatusCode.RESOURCE_EXHAUSTED
    # refused before any output: nothing to time (the span says why)
    assert not points(reader)
