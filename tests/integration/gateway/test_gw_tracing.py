"""Tracing end to end: a real request through a real gateway and a real engine (real
model), both exporting over OTLP to a collector this module runs in process (the
OTLP TraceService over gRPC, on a free port). The span tree joins the client's
traceparent; a gateway with OTEL_SDK_DISABLED exports nothing and still hands the
client's trace id on to the engine.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span as SpanProto

from common.procs import ManagedProcess
from common.redis_server import RedisServer
from tests.conftest import start_engine
from tests.integration.gateway.conftest import GatewayProcess, chat, start_gateway

pytestmark = pytest.mark.integration

GATEWAY_STAGES = {
    "gateway.auth",
    "gateway.reserve",
    "gateway.encode",
    "gateway.route",
    "gateway.first_token",
    "gateway.stream",
    "gateway.settle",
}
ENGINE_PHASES = {"engine.queue", "engine.prefill", "engine.decode"}
PROMPT = "Name a colour of the rainbow, tracing-canary-7"


@dataclass
class Span:
    service: str
    name: str
    kind: int
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict[str, object]
    error: str  # the status message when failed, "" otherwise


def _value(v: AnyValue) -> object:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """Keeps every span it is sent."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self._lock = threading.Lock()

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: object
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        got = []
        for rs in request.resource_spans:
            res = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(
                        Span(
                            service=str(res.get("service.name", "")),
                            name=s.name,
                            kind=s.kind,
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_id=s.parent_span_id.hex(),
                            attributes={a.key: _value(a.value) for a in s.attributes},
                            error=s.status.message if s.status.code == 2 else "",
                        )
                    )
        with self._lock:
            self.spans.extend(got)
        return trace_service_pb2.ExportTraceServiceResponse()

    def of_trace(self, trace_id: str) -> list[Span]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def wait_for(self, trace_id: str, names: set[str], timeout: float = 30) -> list[Span]:
        """The trace's spans once ``names`` are all among them (batches arrive in ~0.1 s)."""
        deadline = time.monotonic() + timeout
        while True:
            spans = self.of_trace(trace_id)
            if names <= {s.name for s in spans}:
                return spans
            if time.monotonic() > deadline:
                raise AssertionError(f"spans {sorted(names)} never arrived; got {spans}")
            time.sleep(0.05)


@dataclass
class Traced:
    collector: Collector
    engine: ManagedProcess
    gateway: GatewayProcess  # tracing on
    untraced: GatewayProcess  # OTEL_SDK_DISABLED=true, same endpoint


def otel_env(endpoint: str, service: str) -> dict[str, str]:
    return {
        "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
        "OTEL_SERVICE_NAME": service,
        "OTEL_BSP_SCHEDULE_DELAY": "50",  # ms: export batches soon after a request
    }


@pytest.fixture(scope="module")
def traced(
    model_dir: Path,
    tokenizer_server: ManagedProcess,
    gw_redis: RedisServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Traced]:
    collector = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)  # type: ignore[no-untyped-call]
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    logs = tmp_path_factory.mktemp("tracing")
    stops: list[Callable[[], object]] = [lambda: server.stop(None)]
    try:
        engine = start_engine("traced-engine", model_dir, logs, otel_env(endpoint, "t-engine"))
        stops.append(engine.stop)
        gateways = []
        for name, extra in (("t-gateway", {}), ("t-gateway-off", {"OTEL_SDK_DISABLED": "true"})):
            gw = start_gateway(
                name,
                [engine.address],
                tokenizer_server.address,
                gw_redis.url,
                logs,
                env={**otel_env(endpoint, name), **extra},
            )
            stops.append(gw.stop)
            gateways.append(gw)
        yield Traced(collector, engine, gateways[0], gateways[1])
    finally:
        for stop in reversed(stops):
            stop()


def traceparent() -> tuple[str, str, str]:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def test_one_trace_from_the_client_through_gateway_stages_to_engine_phases(
    traced: Traced,
) -> None:
    gw = traced.gateway
    tenant_id, key = gw.tenant()
    header, trace_id, client_span = traceparent()
    req = chat(PROMPT, max_tokens=4)
    req.request_id = "trace-test-1"
    chunks = gw.generate(key, req, metadata=(("traceparent", header),))
    num_tokens = sum(len(c.token_ids) for c in chunks)
    spans = traced.collector.wait_for(
        trace_id, {"gateway.request", "gateway.settle", "engine.generate", "engine.decode"}
    )
    one = {s.name: s for s in spans}
    assert len(one) == len(spans), sorted(s.name for s in spans)  # one attempt, one of each
    assert {s.service for s in spans} == {"t-gateway", "t-engine"}

    root = one["gateway.request"]
    assert root.parent_id == client_span
    assert root.kind == SpanProto.SPAN_KIND_SERVER
    assert root.error == ""
    children = {s.name for s in spans if s.parent_id == root.span_id}
    assert children >= GATEWAY_STAGES
    assert children <= GATEWAY_STAGES | {"gateway.take", "gateway.budget"}

    forward = one["gateway.engine"]
    assert forward.kind == SpanProto.SPAN_KIND_CLIENT
    assert forward.parent_id == one["gateway.stream"].span_id
    engine = one["engine.generate"]
    assert engine.service == "t-engine"
    assert engine.parent_id == forward.span_id  # joined by the traceparent the gateway sent
    assert {s.name for s in spans if s.parent_id == engine.span_id} == ENGINE_PHASES

    attrs = root.attributes
    assert attrs["llm.tenant_id"] == tenant_id
    assert attrs["llm.request_id"] == "trace-test-1"
    assert attrs["gen_ai.request.model"] == chunks[0].model
    assert attrs["gen_ai.usage.output_tokens"] == num_tokens
    assert isinstance(attrs["gen_ai.usage.input_tokens"], int)
    assert attrs["gen_ai.usage.input_tokens"] > 0
    assert attrs["rpc.grpc.status_code"] == grpc.StatusCode.OK.value[0]
    engine_id = attrs["llm.engine_request_id"]
    assert engine.attributes["llm.engine_request_id"] == engine_id
    assert forward.attributes["llm.engine_request_id"] == engine_id
    assert engine.attributes["llm.tenant_id"] == tenant_id
    assert engine.attributes["gen_ai.usage.input_tokens"] == attrs["gen_ai.usage.input_tokens"]
    assert engine.attributes["gen_ai.usage.output_tokens"] == num_tokens
    # ids, names and counts only: never the key or the prompt
    values = [str(v) for s in spans for v in s.attributes.values()]
    assert not [v for v in values if key in v or "tracing-canary-7" in v]


def test_a_refused_request_is_a_failed_trace(traced: Traced) -> None:
    header, trace_id, client_span = traceparent()
    with pytest.raises(grpc.RpcError) as info:
        traced.gateway.generate("sk-llm-not-a-key", chat("hi"), metadata=(("traceparent", header),))
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]
    spans = {s.name: s for s in traced.collector.wait_for(trace_id, {"gateway.request"})}
    assert spans["gateway.request"].error == "UNAUTHENTICATED"
    assert spans["gateway.request"].parent_id == client_span
    assert spans["gateway.auth"].error == "UNAUTHENTICATED"
    assert not {"gateway.encode", "gateway.stream"} & set(spans)


def test_with_tracing_disabled_the_gateway_records_nothing(traced: Traced) -> None:
    gw = traced.untraced
    _, key = gw.tenant()
    header, trace_id, client_span = traceparent()
    gw.generate(key, chat("hi", max_tokens=2), metadata=(("traceparent", header),))
    # the engine traces: its span arrives, in the client's trace, under the span id
    # the untraced gateway made up (as before tracing existed)
    spans = traced.collector.wait_for(trace_id, {"engine.generate"})
    (engine,) = [s for s in spans if s.name == "engine.generate"]
    assert engine.parent_id
    assert engine.parent_id != client_span
    gw.stop()  # a traced gateway exports what it holds on the way out
    assert [s for s in traced.collector.spans if s.service == "t-gateway-off"] == []
    assert {s.service for s in traced.collector.of_trace(trace_id)} == {"t-engine"}
