"""The gRPC front believes x-forwarded-for only from a trusted proxy (a real grpc.aio
server on loopback; the pipeline records each call's context)."""

from __future__ import annotations

from typing import cast

import grpc
import pytest

from gateway.domain import CallContext
from gateway.fleet.replica_pool import ModelEntry
from gateway.fronts.forwarded import TrustedProxies
from gateway.fronts.grpc_servicer import GatewayServicer, add_to_server
from gateway.request.pipeline import Pipeline
from llm.v1 import gateway_pb2, gateway_pb2_grpc


class Sources:
    def __init__(self) -> None:
        self.calls: list[CallContext] = []

    async def list_models(self, call: CallContext) -> list[ModelEntry]:
        self.calls.append(call)
        return []


@pytest.mark.parametrize(
    ("proxies", "source"),
    [(None, "127.0.0.1"), (TrustedProxies(["127.0.0.1"]), "198.51.100.9")],
)
async def test_the_grpc_front_reads_x_forwarded_for_only_from_a_proxy(
    proxies: TrustedProxies | None, source: str
) -> None:
    pipeline = Sources()
    server = grpc.aio.server()
    add_to_server(GatewayServicer(cast(Pipeline, pipeline), proxies), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            await gateway_pb2_grpc.GatewayStub(channel).ListModels(
                gateway_pb2.ListModelsRequest(),
                metadata=(("x-forwarded-for", "203.0.113.1, 198.51.100.9"),),
            )
    finally:
        await server.stop(None)
    assert [c.source for c in pipeline.calls] == [source]
