"""common.tracing: the standard OTEL_* variables decide whether a service traces and
exports metrics, and over which OTLP transport (gRPC, or HTTP with protobuf bodies:
spans and metrics reach a real receiver on loopback)."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
from opentelemetry.proto.collector.metrics.v1 import (
    metrics_service_pb2,
    metrics_service_pb2_grpc,
)
from opentelemetry.sdk.trace import Tracer
from opentelemetry.trace import get_current_span

from common import genai, tracing
from tests.support.otlp_http import OtlpHttpReceiver, Received

OTEL_VARS = (
    "OTEL_SDK_DISABLED",
    "OTEL_TRACES_EXPORTER",
    "OTEL_METRICS_EXPORTER",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
    "OTEL_EXPORTER_OTLP_PROTOCOL",
    "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
    "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL",
    "OTEL_SERVICE_NAME",
    "OTEL_RESOURCE_ATTRIBUTES",
    "OTEL_TRACES_SAMPLER",
    "OTEL_TRACES_SAMPLER_ARG",
)
# nothing listens here: no test below makes a span that would be exported
ENDPOINT = "http://127.0.0.1:9"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for var in OTEL_VARS:
        monkeypatch.delenv(var, raising=False)
    yield
    tracing.shutdown()


def sdk_tracer() -> Tracer:
    t = tracing.tracer()
    assert isinstance(t, Tracer)
    return t


def test_no_endpoint_means_no_tracer() -> None:
    assert tracing.setup("gateway") is False
    assert tracing.tracer() is None


@pytest.mark.parametrize(
    ("var", "value"), [("OTEL_SDK_DISABLED", "true"), ("OTEL_TRACES_EXPORTER", "none")]
)
def test_disabled_by_the_standard_switches(
    monkeypatch: pytest.MonkeyPatch, var: str, value: str
) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", ENDPOINT)
    monkeypatch.setenv(var, value)
    assert tracing.setup("gateway") is False
    assert tracing.tracer() is None


@pytest.mark.parametrize(
    "var", ["OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"]
)
def test_an_endpoint_turns_it_on_named_after_the_service(
    monkeypatch: pytest.MonkeyPatch, var: str
) -> None:
    monkeypatch.setenv(var, ENDPOINT)
    assert tracing.setup("engine") is True
    t = sdk_tracer()
    assert t.resource.attributes["service.name"] == "engine"
    assert t.sampler.get_description().startswith("ParentBased{root:AlwaysOnSampler")
    tracing.shutdown()
    assert tracing.tracer() is None


def test_service_name_and_sampler_come_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", ENDPOINT)
    monkeypatch.setenv("OTEL_SERVICE_NAME", "gateway-eu-1")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0.25")
    assert tracing.setup("gateway") is True
    t = sdk_tracer()
    assert t.resource.attributes["service.name"] == "gateway-eu-1"
    assert "0.25" in t.sampler.get_description()


def test_remote_parent_and_traceparent_round_trip() -> None:
    from opentelemetry.sdk.trace import TracerProvider

    provider = TracerProvider(shutdown_on_exit=False)
    parent = tracing.remote_parent("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7", "01")
    span = provider.get_tracer("t").start_span("s", context=parent)
    header = tracing.traceparent(span)
    trace_id, span_id = header.split("-")[1:3]
    assert trace_id == tracing.trace_id(span) == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert span_id != "00f067aa0ba902b7"
    # what an engine reads back is that span
    read = get_current_span(tracing.parent_from_traceparent(header)).get_span_context()
    assert (read.trace_id, read.span_id) == (int(trace_id, 16), int(span_id, 16))
    assert read.is_remote
    provider.shutdown()


def test_the_protocol_key_then_the_standard_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    assert tracing.otlp_protocol() == "grpc"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    assert tracing.otlp_protocol() == "http/protobuf"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
    assert tracing.otlp_protocol(signal="TRACES") == "grpc"
    assert tracing.otlp_protocol(signal="METRICS") == "http/protobuf"
    assert tracing.otlp_protocol("http/protobuf", "TRACES") == "http/protobuf"


@pytest.mark.parametrize("bad", ["http/json", "zipkin"])
def test_an_unsupported_protocol_is_refused(monkeypatch: pytest.MonkeyPatch, bad: str) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    with pytest.raises(ValueError, match="not supported"):
        tracing.setup("gateway", bad)


def test_metrics_follow_their_own_switches(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://127.0.0.1:9")
    assert tracing.setup("gateway") is True
    assert tracing.meter() is None  # no endpoint for metrics
    tracing.shutdown()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "none")
    tracing.setup("gateway")
    assert tracing.meter() is None
    assert tracing.tracer() is not None


def _exported(got: Received) -> bool:
    return bool(got.spans) and "gen_ai.client.token.usage" in got.points


@pytest.mark.parametrize("how", ["key", "env"])
def test_spans_and_metrics_over_http(monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    with OtlpHttpReceiver() as receiver:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
        if how == "env":
            monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
        assert tracing.setup("probe", "http/protobuf" if how == "key" else "") is True
        tracer, instruments = tracing.tracer(), genai.instruments(tracing.meter())
        assert tracer is not None
        assert instruments is not None
        tracer.start_span("probe.span", attributes={"gen_ai.operation.name": "chat"}).end()
        instruments.token_usage.record(7, {"gen_ai.token.type": "input"})
        tracing.shutdown()  # flushes both
        got = receiver.wait(_exported)
    assert {"/v1/traces", "/v1/metrics"} <= set(got.paths)
    (span,) = got.spans
    assert (span.service, span.name) == ("probe", "probe.span")
    assert span.attributes["gen_ai.operation.name"] == "chat"
    (point,) = got.points["gen_ai.client.token.usage"]
    assert (point.unit, point.sum, point.count) == ("{token}", 7, 1)
    assert point.bounds[:3] == [1, 4, 16]


class _Metrics(metrics_service_pb2_grpc.MetricsServiceServicer):
    def __init__(self) -> None:
        self.names: list[str] = []

    def Export(
        self, request: metrics_service_pb2.ExportMetricsServiceRequest, context: object
    ) -> metrics_service_pb2.ExportMetricsServiceResponse:
        self.names += [
            m.name for rm in request.resource_metrics for sm in rm.scope_metrics for m in sm.metrics
        ]
        return metrics_service_pb2.ExportMetricsServiceResponse()


def test_metrics_over_grpc(monkeypatch: pytest.MonkeyPatch) -> None:
    received = _Metrics()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(received, server)  # type: ignore[no-untyped-call]
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", f"http://127.0.0.1:{port}")
        assert tracing.setup("probe") is False  # metrics only: no endpoint for traces
        instruments = genai.instruments(tracing.meter())
        assert instruments is not None
        instruments.request_duration.record(0.5, {"gen_ai.operation.name": "chat"})
        tracing.shutdown()
    finally:
        server.stop(None)
    assert received.names == ["gen_ai.server.request.duration"]


def test_instruments_follow_their_meter_even_when_an_old_meters_id_is_reused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each new meter provider (a service's restart, every test here) gets instruments of
    its own, so its records reach its reader. CPython gives a collected object's address
    (its id) to the next one, so a cache keyed by id() handed a new meter the old,
    shut-down provider's instruments now and then (a CI run lost its OTLP export so);
    here every id collides."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    monkeypatch.setattr(genai, "id", lambda _obj: 1, raising=False)
    for i in range(3):
        reader = InMemoryMetricReader()
        provider = MeterProvider(metric_readers=[reader])
        meter = provider.get_meter("probe")
        instruments = genai.instruments(meter)
        assert instruments is not None
        assert genai.instruments(meter) is instruments  # made once per meter
        instruments.request_duration.record(0.25, {"gen_ai.operation.name": "chat"})
        data = reader.get_metrics_data()
        assert data is not None
        names = [
            m.name for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics
        ]
        assert names == ["gen_ai.server.request.duration"], f"meter {i}"
        provider.shutdown()
