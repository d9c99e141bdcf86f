"""common.tracing: the standard OTEL_* variables decide whether a service traces."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace import Tracer
from opentelemetry.trace import get_current_span

from common import tracing

OTEL_VARS = (
    "OTEL_SDK_DISABLED",
    "OTEL_TRACES_EXPORTER",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
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
