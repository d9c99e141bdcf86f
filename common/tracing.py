"""OpenTelemetry tracing of every service, configured by the standard ``OTEL_*`` variables.

``setup(service)`` (called by ``common.server.run_service``) installs an SDK tracer
provider with a batching OTLP/gRPC exporter when an endpoint is configured
(``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_ENDPOINT``) and
``OTEL_SDK_DISABLED`` is not ``true``. The exporter, sampler (``OTEL_TRACES_SAMPLER``,
``OTEL_TRACES_SAMPLER_ARG``), batching (``OTEL_BSP_*``) and resource
(``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``) read their own variables.

Otherwise nothing is installed and ``tracer()`` is None: call sites test that
once per request and, when tracing is off, build no span, context or attribute
(the gateway's added latency is a measured figure). Spans are started with
explicit parents and never made "current", so no context variable is attached
across the awaits and yields of a streaming call.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from common.log import get_logger

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

log = get_logger(__name__)
INSTRUMENTATION = "llm-serving-stack"
_ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
_W3C = TraceContextTextMapPropagator()
_tracer: trace.Tracer | None = None
_provider: TracerProvider | None = None


def tracer() -> trace.Tracer | None:
    """The process's tracer, or None while tracing is off."""
    return _tracer


def configured_endpoint() -> str:
    """The OTLP endpoint the environment names ("" = none: tracing stays off)."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return ""
    if os.environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() == "none":
        return ""
    return next((os.environ[v].strip() for v in _ENDPOINT_VARS if os.environ.get(v)), "")


def setup(service: str) -> bool:
    """Export spans over OTLP when the environment asks for it; True when tracing is on.

    ``service`` names the resource unless ``OTEL_SERVICE_NAME`` (or ``service.name`` in
    ``OTEL_RESOURCE_ATTRIBUTES``) does.
    """
    endpoint = configured_endpoint()
    if not endpoint:
        return False
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get(
        "OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"
    )
    if protocol.strip().lower() != "grpc":
        log.warning("only OTLP over gRPC is built in; exporting with it", protocol=protocol)
    # the SDK and exporter load only when tracing is on
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create({})
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: service}))
    provider = TracerProvider(resource=resource, shutdown_on_exit=False)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    use_provider(provider)
    log.info(
        "tracing on",
        endpoint=endpoint,
        service_name=resource.attributes.get(SERVICE_NAME),
        sampler=provider.sampler.get_description(),
    )
    return True


def use_provider(provider: TracerProvider | None) -> None:
    """Trace with ``provider`` from now on (None = off). ``setup`` calls it; so do tests,
    with an in-memory exporter."""
    global _tracer, _provider
    _provider = provider
    _tracer = provider.get_tracer(INSTRUMENTATION) if provider is not None else None


def shutdown() -> None:
    """Export what is buffered and stop tracing (a service's last step)."""
    provider = _provider
    use_provider(None)
    if provider is not None:
        provider.shutdown()


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
