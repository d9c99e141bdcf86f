"""An OTLP/HTTP receiver on loopback for tests: it decodes the protobuf bodies POSTed to
``/v1/traces`` and ``/v1/metrics`` (ExportTraceServiceRequest, ExportMetricsServiceRequest)
and keeps what they carry, flattened: spans with their attributes, and metric data points
by metric name."""

from __future__ import annotations

import http.server
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue


def value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


def attributes(kvs: Any) -> dict[str, Any]:
    return {kv.key: value(kv.value) for kv in kvs if isinstance(kv, KeyValue)}


@dataclass
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    attributes: dict[str, Any]


@dataclass
class ReceivedPoint:
    service: str
    unit: str
    attributes: dict[str, Any]
    count: int
    sum: float
    bounds: list[float]


@dataclass
class Received:
    paths: list[str] = field(default_factory=list)
    spans: list[ReceivedSpan] = field(default_factory=list)
    points: dict[str, list[ReceivedPoint]] = field(default_factory=dict)


class OtlpHttpReceiver:
    """Serves OTLP/HTTP on 127.0.0.1 (an ephemeral port) in a thread; ``endpoint`` is
    what ``OTEL_EXPORTER_OTLP_ENDPOINT`` should say. Use as a context manager."""

    def __init__(self) -> None:
        self.got = Received()
        self._lock = threading.Lock()
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                ok = receiver._take(self.path, self.headers.get("Content-Type", ""), body)
                self.send_response(200 if ok else 404)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> OtlpHttpReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _take(self, path: str, content_type: str, body: bytes) -> bool:
        if content_type != "application/x-protobuf":
            return False
        if path == "/v1/traces":
            req = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
            spans = [
                ReceivedSpan(
                    str(attributes(rs.resource.attributes).get("service.name", "")),
                    s.name,
                    s.trace_id.hex(),
                    attributes(s.attributes),
                )
                for rs in req.resource_spans
                for ss in rs.scope_spans
                for s in ss.spans
            ]
            with self._lock:
                self.got.paths.append(path)
                self.got.spans.extend(spans)
            return True
        if path == "/v1/metrics":
            mreq = metrics_service_pb2.ExportMetricsServiceRequest.FromString(body)
            with self._lock:
                self.got.paths.append(path)
                for rm in mreq.resource_metrics:
                    service = str(attributes(rm.resource.attributes).get("service.name", ""))
                    for sm in rm.scope_metrics:
                        for m in sm.metrics:
                            if m.WhichOneof("data") != "histogram":
                                continue
                            self.got.points.setdefault(m.name, []).extend(
                                ReceivedPoint(
                                    service,
                                    m.unit,
                                    attributes(p.attributes),
                                    p.count,
                                    p.sum,
                                    list(p.explicit_bounds),
                                )
                                for p in m.histogram.data_points
                            )
            return True
        return False

    def wait(self, ready: Any, timeout: float = 30) -> Received:
        """``self.got`` once ``ready(self.got)`` is true (exports arrive in batches)."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                if ready(self.got):
                    return self.got
            if time.monotonic() > deadline:
                raise AssertionError(f"OTLP data never arrived; got {self.got}")
            time.sleep(0.05)
