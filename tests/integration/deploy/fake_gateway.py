"""In-process stand-ins for gateway replicas, to watch what Envoy does to their failures.

Each replica serves ``llm.v1.Gateway`` (with a behaviour that a test switches)
and ``grpc.health.v1.Health`` SERVING for ``llm.v1.Gateway``, so Envoy's active
health check admits it. ``calls`` counts the Generate calls that reached it.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from llm.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

if TYPE_CHECKING:
    Context = grpc.ServicerContext
else:
    Context = Any


class Mode(enum.Enum):
    OK = "ok"  # three chunks, then a clean end
    UNAVAILABLE_AT_ONCE = "unavailable_at_once"  # trailers-only UNAVAILABLE
    UNAVAILABLE_AFTER_FIRST_CHUNK = "unavailable_after_first_chunk"
    SLOW = "slow"  # the three chunks 0.8 s apart: a stream that outlives short timeouts


class FakeGateway(gateway_pb2_grpc.GatewayServicer):
    """One replica on 127.0.0.1, port 0."""

    def __init__(self, name: str, mode: Mode = Mode.OK) -> None:
        self.name = name
        self.mode = mode
        self.calls = 0
        self._lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        gateway_pb2_grpc.add_GatewayServicer_to_server(self, self.server)
        health_servicer = health.HealthServicer()
        health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        health_servicer.set("llm.v1.Gateway", health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> FakeGateway:
        self.server.start()
        return self

    def stop(self) -> None:
        self.server.stop(0).wait(5)

    def Generate(
        self, request: gateway_pb2.GenerateRequest, context: Context
    ) -> Iterator[gateway_pb2.GenerateResponse]:
        with self._lock:
            self.calls += 1
        if self.mode is Mode.UNAVAILABLE_AT_ONCE:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.name}: no healthy engine")
        yield gateway_pb2.GenerateResponse(request_id=request.request_id, text=self.name)
        if self.mode is Mode.UNAVAILABLE_AFTER_FIRST_CHUNK:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.name}: engine died mid-stream")
        for text in (" says", " hi"):
            if self.mode is Mode.SLOW:
                time.sleep(0.8)
            yield gateway_pb2.GenerateResponse(request_id=request.request_id, text=text)
        yield gateway_pb2.GenerateResponse(
            request_id=request.request_id, finish_reason=common_pb2.STOP
        )

    def ListModels(
        self, request: gateway_pb2.ListModelsRequest, context: Context
    ) -> gateway_pb2.ListModelsResponse:
        return gateway_pb2.ListModelsResponse()
