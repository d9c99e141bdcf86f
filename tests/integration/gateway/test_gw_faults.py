"""Engine replica failures through the gateway: failover, breaker, routing to the survivor.

One replica is SIGKILLed while it streams; it is restarted on the same port
afterwards (the breaker then closes again). Greedy requests make "no token
repeated or lost" exact: the failed-over stream equals an uninterrupted run.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from common.procs import ManagedProcess
from common.redis_server import RedisServer
from llm.v1 import common_pb2, engine_pb2, engine_pb2_grpc, gateway_pb2
from tests.integration.gateway.conftest import EnginePair, GatewayProcess, chat, start_gateway

pytestmark = pytest.mark.integration

FAULT_ENV = {
    "LLM_GATEWAY_BREAKER_CONSECUTIVE_FAILURES": "1",
    "LLM_GATEWAY_BREAKER_OPEN_S": "1",
}
STORY = chat(
    "Write a long story about a dragon who learns to bake bread.", max_tokens=40, ignore_eos=True
)


def _gateway(
    name: str,
    env: dict[str, str],
    engines: EnginePair,
    tokenizer: ManagedProcess,
    redis: RedisServer,
    log_dir: Path,
) -> Iterator[GatewayProcess]:
    engines.ensure_running()
    gw = start_gateway(name, engines.addresses, tokenizer.address, redis.url, log_dir, env)
    try:
        wait_until(lambda: gw.metric("gateway_replica_healthy") == 2)
        yield gw
    finally:
        gw.stop()
        engines.ensure_running()


@pytest.fixture(scope="module")
def gw_fault(
    engines: EnginePair,
    tokenizer_server: ManagedProcess,
    gw_redis: RedisServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[GatewayProcess]:
    yield from _gateway(
        "gateway-fault",
        FAULT_ENV,
        engines,
        tokenizer_server,
        gw_redis,
        tmp_path_factory.mktemp("gateway-fault"),
    )


@pytest.fixture(scope="module")
def gw_no_failover(
    engines: EnginePair,
    tokenizer_server: ManagedProcess,
    gw_redis: RedisServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[GatewayProcess]:
    yield from _gateway(
        "gateway-nofailover",
        {**FAULT_ENV, "LLM_GATEWAY_FAILOVER": "false"},
        engines,
        tokenizer_server,
        gw_redis,
        tmp_path_factory.mktemp("gateway-nofailover"),
    )


def wait_until(fn: object, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not fn():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def engine_stats(address: str) -> engine_pb2.EngineStats:
    with grpc.insecure_channel(address) as ch:
        return engine_pb2_grpc.EngineStub(ch).GetStats(engine_pb2.GetStatsRequest(), timeout=5)


def serving_replica(engines: EnginePair) -> int:
    """Index of the replica that is running a request now."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for i, address in enumerate(engines.addresses):
            if engine_stats(address).num_running:
                return i
        time.sleep(0.01)
    raise AssertionError("no engine replica is running the request")


def start_and_kill(
    gw: GatewayProcess, key: str, engines: EnginePair
) -> tuple[list[int], Iterator[gateway_pb2.GenerateResponse], int]:
    """Start STORY, read a few tokens, SIGKILL the replica serving it."""
    call = gw.stub.Generate(STORY, metadata=(("authorization", f"Bearer {key}"),), timeout=60)
    stream = iter(call)
    got: list[int] = []
    while len(got) < 4:
        got.extend(next(stream).token_ids)
    victim = serving_replica(engines)
    engines.procs[victim].signal(signal.SIGKILL)
    return got, stream, victim


def test_failover_mid_stream_then_survivor_then_breaker_closes(
    gw_fault: GatewayProcess, engines: EnginePair
) -> None:
    _, key = gw_fault.tenant()
    reference = gw_fault.generate(key, STORY)
    ref_ids = [t for c in reference for t in c.token_ids]
    ref_text = "".join(c.text for c in reference)

    head_ids, stream, victim = start_and_kill(gw_fault, key, engines)
    head = list(stream)
    ids = head_ids + [t for c in head for t in c.token_ids]
    assert ids == ref_ids  # no token repeated or lost
    assert head[-1].finish_reason == common_pb2.LENGTH
    assert head[-1].usage.completion_tokens == 40
    assert gw_fault.metric("gateway_failovers_total") >= 1
    victim_addr = engines.addresses[victim]
    # ejected: OPEN, or already HALF_OPEN after breaker.open_s (it waits for a probe)
    assert gw_fault.metric("gateway_breaker_state", replica=victim_addr) >= 1
    log = gw_fault.proc.log_path.read_text()
    assert '"state": "OPEN"' in log
    assert victim_addr in log

    survivor = engines.addresses[1 - victim]
    before = engine_stats(survivor).num_requests_total
    for _ in range(3):
        chunks = gw_fault.generate(key, chat("hi", max_tokens=2))
        assert chunks[-1].finish_reason
    assert engine_stats(survivor).num_requests_total == before + 3

    engines.restart(victim)

    def closed_again() -> bool:
        gw_fault.generate(key, chat("hi", max_tokens=1))
        return gw_fault.metric("gateway_breaker_state", replica=victim_addr) == 0

    wait_until(closed_again, timeout=60)
    # text continuity across the failover, checked on the whole stream
    assert ref_text == "".join(c.text for c in gw_fault.generate(key, STORY))


def test_without_failover_the_stream_ends_with_a_clear_status(
    gw_no_failover: GatewayProcess, engines: EnginePair
) -> None:
    _, key = gw_no_failover.tenant()
    head_ids, stream, victim = start_and_kill(gw_no_failover, key, engines)

    def drain() -> None:
        for chunk in stream:
            head_ids.extend(chunk.token_ids)

    with pytest.raises(grpc.RpcError) as info:
        drain()
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    details = info.value.details() or ""
    assert "failover is off" in details
    assert f"after {len(head_ids)} output tokens" in details
    # new requests still work, on the survivor
    assert gw_no_failover.generate(key, chat("hi", max_tokens=2))[-1].finish_reason
    engines.restart(victim)
