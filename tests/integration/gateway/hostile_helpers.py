"""What the hostile-caller tests share: a long request, and the check that a finished
request left nothing held (in-flight gauge, replica slots, leases, engine queues)."""

from __future__ import annotations

import time
from collections.abc import Callable

import grpc

from llm.v1 import engine_pb2, engine_pb2_grpc
from tests.integration.gateway.conftest import EnginePair, GatewayProcess, chat

LONG = chat("Count from one to one hundred, one number per line.", max_tokens=48, ignore_eos=True)


def wait_until(cond: Callable[[], bool], timeout: float = 20.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def assert_idle(gw: GatewayProcess, tenant_id: str, engines: EnginePair) -> None:
    """Nothing a finished request took is still held, anywhere."""
    assert wait_until(lambda: gw.metric("gateway_in_flight") == 0), "requests still in flight"
    assert wait_until(lambda: gw.metric("gateway_replica_outstanding") == 0), (
        "a replica slot was never released"
    )
    assert wait_until(lambda: gw.usage(tenant_id).concurrent_in_use == 0), "a lease leaked"
    for address in engines.addresses:
        with grpc.insecure_channel(address) as ch:
            stub = engine_pb2_grpc.EngineStub(ch)

            def engine_idle(stub: engine_pb2_grpc.EngineStub = stub) -> bool:
                stats = stub.GetStats(engine_pb2.GetStatsRequest())
                return stats.num_running == 0 and stats.num_waiting == 0

            assert wait_until(engine_idle), f"engine {address} still holds requests"


def stage_count(gateway: GatewayProcess, name: str) -> float:
    """How many times the gateway recorded admission stage ``name``."""
    return gateway.metric("gateway_stage_seconds_count", stage=name)


def gateway_encodes(gateway: GatewayProcess) -> float:
    """Prompts the gateway tokenized (in process or through tokenizer_svc)."""
    return stage_count(gateway, "encode")
