"""Every engine full: the gateway queues briefly in per-tenant fair queues instead of
refusing, and a flood from one tenant does not push another tenant to the back.

A real engine with room for two requests (one running, one waiting) behind two real
gateways: one with the fair queue (the default), one with it off
(``queue_max_wait_ms: 0``), which refuses at once as before.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from common.procs import ManagedProcess
from common.redis_server import RedisServer
from tests.conftest import engine_running
from tests.integration.gateway.conftest import GatewayProcess, chat, start_gateway

pytestmark = pytest.mark.integration
PROMPT = "Tell me a long story about a cat."


@pytest.fixture(scope="module")
def small_engine(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ManagedProcess]:
    with engine_running(
        "gw-small-engine",
        model_dir,
        tmp_path_factory.mktemp("gw-small-engine"),
        env={
            "LLM_ENGINE_CORE_SCHEDULER_MAX_NUM_SEQS": "1",
            "LLM_ENGINE_CORE_SCHEDULER_MAX_WAITING": "1",
        },
    ) as proc:
        yield proc


def gateway_on(
    small_engine: ManagedProcess,
    tokenizer_server: ManagedProcess,
    gw_redis: RedisServer,
    tmp: Path,
    name: str,
    wait_ms: int,
) -> GatewayProcess:
    return start_gateway(
        name,
        [small_engine.address],
        tokenizer_server.address,
        gw_redis.url,
        tmp,
        {
            "LLM_GATEWAY_QUEUE_MAX_WAIT_MS": str(wait_ms),
            "LLM_GATEWAY_MAX_ATTEMPTS": "1",  # one replica: nothing to retry on
            "LLM_RATELIMIT_KEY_PREFIX": f"{name}:",
        },
    )


@pytest.fixture(scope="module")
def queued_gw(
    small_engine: ManagedProcess,
    tokenizer_server: ManagedProcess,
    gw_redis: RedisServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[GatewayProcess]:
    gw = gateway_on(
        small_engine, tokenizer_server, gw_redis, tmp_path_factory.mktemp("fq"), "gw-fq", 30_000
    )
    try:
        yield gw
    finally:
        gw.stop()


def wait_for(check: object, what: str, within_s: float = 60.0) -> None:
    end = time.monotonic() + within_s
    while not check():  # type: ignore[operator]
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_a_flood_waits_in_line_and_the_other_tenant_is_served_before_it(
    queued_gw: GatewayProcess,
) -> None:
    gw = queued_gw
    flood_id, flood_key = gw.tenant()
    chat_id, chat_key = gw.tenant()
    done: list[str] = []
    lock = threading.Lock()

    def call(who: str, key: str) -> int:
        out = gw.generate(
            key, chat("Tell me a long story about a cat.", max_tokens=24), timeout=120
        )
        with lock:
            done.append(who)
        return out[-1].usage.completion_tokens

    with ThreadPoolExecutor(max_workers=8) as pool:
        flood = [pool.submit(call, "flood", flood_key) for _ in range(6)]
        # two in the engine (running + waiting), four in the gateway's queue
        wait_for(lambda: gw.metric("gateway_fair_queue_waiting") >= 4, "the flood to queue")
        chats = [pool.submit(call, "chat", chat_key) for _ in range(2)]
        results = [f.result() for f in [*flood, *chats]]
    assert results == [24] * 8  # nobody refused: the wait was bounded, not needed to end
    # FIFO would serve the chat tenant last (it came behind four queued flood requests);
    # fair turns put it between them, so flood requests finish after both of its
    assert done.index("chat") < len(done) - 2
    assert max(i for i, who in enumerate(done) if who == "chat") < len(done) - 1
    assert gw.metric("gateway_fair_queue_waiting") == 0
    assert gw.metric("gateway_fair_queue_wait_seconds_count") >= 5
    for tid in (flood_id, chat_id):  # every concurrency lease went back
        assert gw.usage(tid).concurrent_in_use == 0


def test_with_the_queue_off_a_full_engine_refuses_at_once(
    small_engine: ManagedProcess,
    tokenizer_server: ManagedProcess,
    gw_redis: RedisServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    gw = gateway_on(
        small_engine, tokenizer_server, gw_redis, tmp_path_factory.mktemp("nofq"), "gw-nofq", 0
    )
    try:
        _, key = gw.tenant()
        errors: list[grpc.StatusCode] = []

        def call() -> None:
            try:
                gw.generate(key, chat(PROMPT, max_tokens=24))
            except grpc.RpcError as e:
                errors.append(e.code())  # type: ignore[attr-defined]

        with ThreadPoolExecutor(max_workers=6) as pool:
            list(pool.map(lambda _: call(), range(6)))
        assert errors
        assert set(errors) == {grpc.StatusCode.RESOURCE_EXHAUSTED}
        assert gw.metric("gateway_fair_queue_wait_seconds_count") == 0
    finally:
        gw.stop()
