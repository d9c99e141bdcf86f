"""OpenTelemetry traces and metrics of every service, over OTLP, configured by the
standard ``OTEL_*`` variables.

``setup(service, protocol)`` (called by ``common.server.run_service``) installs an SDK
tracer provider with a batching OTLP span exporter when an endpoint is configured
(``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_ENDPOINT``), and a meter
provider exporting every ``OTEL_METRIC_EXPORT_INTERVAL`` ms (default 60 s) when one is
configured for metrics (``OTEL_EXPORTER_OTLP_METRICS_ENDPOINT`` or
``OTEL_EXPORTER_OTLP_ENDPOINT``); ``OTEL_SDK_DISABLED=true`` turns both off,
``OTEL_TRACES_EXPORTER=none`` / ``OTEL_METRICS_EXPORTER=none`` one each. The transport
is OTLP over gRPC or over HTTP (protobuf bodies): the service's ``otlp_protocol`` key,
else ``OTEL_EXPORTER_OTLP_{TRACES,METRICS}_PROTOCOL``, else
``OTEL_EXPORTER_OTLP_PROTOCOL``, else ``grpc``. Over HTTP the general endpoint gets the
signal's path (``/v1/traces``, ``/v1/metrics``); a signal's own endpoint is used as
given. The exporters, sampler (``OTEL_TRACES_SAMPLER``, ``OTEL_TRACES_SAMPLER_ARG``),
batching (``OTEL_BSP_*``) and resource (``OTEL_SERVICE_NAME``,
``OTEL_RESOURCE_ATTRIBUTES``) read their own variables.

Otherwise nothing is installed and ``tracer()`` / ``meter()`` are None: call sites test
that once per request and, when tracing is off, build no span, context or attribute
(the gateway's added latency is a measured figure). Spans are started with
explicit parents and never made "current", so no context variable is attached
across the awaits and yields of a streaming call.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from opentelemetry import metrics, trace
from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from common.log import get_logger

if TYPE_CHECKING:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import MetricExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter

log = get_logger(__name__)
INSTRUMENTATION = "llm-serving-stack"
_ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
_METRICS_ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
PROTOCOLS = ("grpc", "http/protobuf")
_W3C = TraceContextTextMapPropagator()
_tracer: trace.Tracer | None = None
_provider: TracerProvider | None = None
_meter: metrics.Meter | None = None
_meter_provider: MeterProvider | None = None


def tracer() -> trace.Tracer | None:
    """The process's tracer, or None while tracing is off."""
    return _tracer


def meter() -> metrics.Meter | None:
    """The process's meter (OTLP metrics), or None while they are off."""
    return _meter


def _off(exporter_var: str) -> bool:
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return True
    return os.environ.get(exporter_var, "otlp").strip().lower() == "none"


def configured_endpoint() -> str:
    """The OTLP endpoint the environment names for traces ("" = none: tracing stays off)."""
    if _off("OTEL_TRACES_EXPORTER"):
        return ""
    return next((os.environ[v].strip() for v in _ENDPOINT_VARS if os.environ.get(v)), "")


def configured_metrics_endpoint() -> str:
    """The OTLP endpoint the environment names for metrics ("" = none: they stay off)."""
    if _off("OTEL_METRICS_EXPORTER"):
        return ""
    return next((os.environ[v].strip() for v in _METRICS_ENDPOINT_VARS if os.environ.get(v)), "")


def otlp_protocol(configured: str = "", signal: str = "TRACES") -> str:
    """``grpc`` or ``http/protobuf``: ``configured`` (a service's ``otlp_protocol``), else
    the signal's ``OTEL_EXPORTER_OTLP_<SIGNAL>_PROTOCOL``, else
    ``OTEL_EXPORTER_OTLP_PROTOCOL``, else ``grpc``.

    Raises:
        ValueError: any other value (``http/json`` included: not built in).
    """
    raw = (
        configured
        or os.environ.get(f"OTEL_EXPORTER_OTLP_{signal}_PROTOCOL")
        or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "grpc"
    )
    protocol = raw.strip().lower()
    if protocol not in PROTOCOLS:
        raise ValueError(f"OTLP protocol {raw!r} is not supported: use one of {PROTOCOLS}")
    return protocol


def _span_exporter(protocol: str) -> SpanExporter:
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # type: ignore[assignment]
            OTLPSpanExporter,
        )
    return OTLPSpanExporter()


def _metric_exporter(protocol: str) -> MetricExporter:
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import (  # type: ignore[assignment]
            OTLPMetricExporter,
        )
    return OTLPMetricExporter()


def _resource(service: str) -> Resource:
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource

    resource = Resource.create({})
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: service}))
    return resource


def setup(service: str, protocol: str = "") -> bool:
    """Export spans and metrics over OTLP when the environment asks for it; True when
    tracing is on.

    Args:
        service: Names the resource unless ``OTEL_SERVICE_NAME`` (or ``service.name`` in
            ``OTEL_RESOURCE_ATTRIBUTES``) does.
        protocol: ``grpc`` or ``http/protobuf`` ("" = the standard variables decide).

    Raises:
        ValueError: an unsupported protocol (configured or in the environment).
    """
    endpoint, metrics_endpoint = configured_endpoint(), configured_metrics_endpoint()
    if metrics_endpoint:
        _setup_metrics(service, otlp_protocol(protocol, "METRICS"), metrics_endpoint)
    if not endpoint:
        return False
    chosen = otlp_protocol(protocol, "TRACES")
    # the SDK and exporter load only when tracing is on
    from opentelemetry.sdk.resources import SERVICE_NAME
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = _resource(service)
    provider = TracerProvider(resource=resource, shutdown_on_exit=False)
    provider.add_span_processor(BatchSpanProcessor(_span_exporter(chosen)))
    use_provider(provider)
    log.info(
        "tracing on",
        endpoint=endpoint,
        protocol=chosen,
        service_name=resource.attributes.get(SERVICE_NAME),
        sampler=provider.sampler.get_description(),
    )
    return True


def _setup_metrics(service: str, protocol: str, endpoint: str) -> None:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

    reader = PeriodicExportingMetricReader(_metric_exporter(protocol))
    use_meter_provider(
        MeterProvider(resource=_resource(service), metric_readers=[reader], shutdown_on_exit=False)
    )
    log.info("OTLP metrics on", endpoint=endpoint, protocol=protocol)


def use_meter_provider(provider: MeterProvider | None) -> None:
    """Record metrics with ``provider`` from now on (None = off); tests use an in-memory
    reader."""
    global _meter, _meter_provider
    _meter_provider = provider
    _meter = provider.get_meter(INSTRUMENTATION) if provider is not None else None


def use_provider(provider: TracerProvider | None) -> None:
    """Trace with ``provider`` from now on (None = off). ``setup`` calls it; so do tests,
    with an in-memory exporter."""
    global _tracer, _provider
    _provider = provider
    _tracer = provider.get_tracer(INSTRUMENTATION) if provider is not None else None


def shutdown() -> None:
    """Export what is buffered and stop tracing and metrics (a service's last step)."""
    provider, meters = _provider, _meter_provider
    use_provider(None)
    use_meter_provider(None)
    if provider is not None:
        provider.shutdown()
    if meters is not None:
        meters.shutdown()


def parent_from_traceparent(header: str) -> Context:
    """The remote parent a W3C ``traceparent`` names (an empty context when malformed:
    the span then starts a trace)."""
    return _W3C.extract({"traceparent": header}) if header else Context()


def remote_parent(trace_id: str, span_id: str, flags: str) -> Context:
    """The context of a remote parent span given in hex (``span_id`` "" = no parent)."""
    if not span_id:
        return Context()
    flags_ = trace.TraceFlags(int(flags, 16))
    parent = trace.SpanContext(int(trace_id, 16), int(span_id, 16), True, flags_)
    return trace.set_span_in_context(trace.NonRecordingSpan(parent))


def traceparent(span: trace.Span) -> str:
    """The W3C ``traceparent`` that makes a downstream span a child of ``span``."""
    ctx = span.get_span_context()
    return (
        f"00-{trace.format_trace_id(ctx.trace_id)}-{trace.format_span_id(ctx.span_id)}"
        f"-{int(ctx.trace_flags):02x}"
    )


def trace_id(span: trace.Span) -> str:
    """The span's trace id in hex (as logs carry it)."""
    return trace.format_trace_id(span.get_span_context().trace_id)


def wall_clock(clock_now_s: float) -> Callable[[float], int]:
    """Readings of a monotonic clock (``time.monotonic()``, ``time.perf_counter()``) as
    unix nanoseconds, as spans take them; ``clock_now_s`` is that clock now. One anchor
    for several readings keeps the intervals between them exact."""
    wall_now = time.time_ns()
    return lambda clock_s: wall_now - round((clock_now_s - clock_s) * 1e9)


def end_with_error(span: trace.Span, description: str) -> None:
    """Mark ``span`` failed (a gRPC status name or an exception's) and end it."""
    span.set_status(trace.Status(trace.StatusCode.ERROR, description))
    span.end()
