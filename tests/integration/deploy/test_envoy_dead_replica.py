"""A dead gateway replica fails no new stream while a healthy one exists (two fake
replicas behind a real Envoy with the real config): a burst of new streams arrives
right after one replica's port closed, while the other's streams run long, and
every stream is retried onto the live replica and completes."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from deploy.envoy import EnvoyProcess, render_config_file
from llm.v1 import gateway_pb2, gateway_pb2_grpc
from tests.integration.deploy.fake_gateway import FakeGateway, Mode

pytestmark = pytest.mark.integration
RUNNING = 2  # long streams on the live replica when the burst comes
BURST = 6  # new streams at once (the live replica's server runs 8 at a time)


@pytest.fixture
def one_dead(tmp_path: Path) -> Iterator[tuple[EnvoyProcess, FakeGateway, FakeGateway]]:
    dead = FakeGateway("a", Mode.OK).start()
    live = FakeGateway("b", Mode.SLOW).start()  # streams of 1.6 s: their retries stay active
    envoy = None
    try:
        config = render_config_file(
            tmp_path / "envoy.yaml",
            listener_host="127.0.0.1",
            plaintext=True,
            listener_port=0,
            admin_port=0,
            gateway=[dead.address, live.address],
            admin=[live.address],
            access_log_path=tmp_path / "access.log",
        )
        envoy = EnvoyProcess(config, log_dir=tmp_path).start()
        dead.stop()  # its port refuses connections from now on
        yield envoy, dead, live
    finally:
        if envoy is not None:
            envoy.stop()
        live.stop()


async def stream(stub: gateway_pb2_grpc.GatewayAsyncStub) -> str | grpc.StatusCode:
    try:
        chunks = [c.text async for c in stub.Generate(gateway_pb2.GenerateRequest(prompt="hi"))]
    except grpc.aio.AioRpcError as err:
        return err.code()
    return "".join(chunks)


async def test_a_burst_of_new_streams_after_a_replica_died_all_reach_the_live_one(
    one_dead: tuple[EnvoyProcess, FakeGateway, FakeGateway],
) -> None:
    envoy, dead, live = one_dead
    async with grpc.aio.insecure_channel(envoy.listener_address()) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        # streams already running on the live replica: the dead one, with none, is
        # where the least-request balancer sends the burst first
        running = [asyncio.create_task(stream(stub)) for _ in range(RUNNING)]
        for _ in range(1000):
            if live.calls == RUNNING:
                break
            await asyncio.sleep(0.01)
        # one HTTP/2 connection: Envoy reads the burst at once, before any of its
        # connects to the dead replica has failed
        burst = await asyncio.gather(*(stream(stub) for _ in range(BURST)))
        results = [*await asyncio.gather(*running), *burst]
    assert results == ["b says hi"] * (RUNNING + BURST), results
    assert dead.calls == 0
    assert live.calls == RUNNING + BURST
    stats = envoy.stats(r"^cluster\.gateway\.upstream_rq_retry")
    assert stats["cluster.gateway.upstream_rq_retry_overflow"] == 0
