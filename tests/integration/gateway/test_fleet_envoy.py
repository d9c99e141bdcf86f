"""A fleet through Envoy: two gateways and three engines under a mixed load; a gateway
killed, then an engine killed; then nothing is left behind.

    clients ──► Envoy ──► gateway 0 (SIGKILLed mid-load) ─┬─► engines: the pair + the
                      └─► gateway 1 ───────────────────────┘   session engine

Clients of the killed gateway get UNAVAILABLE (nothing else, nothing hangs); new
requests go to the survivor; the survivor's streams on the killed engine fail over
and finish whole. Afterwards: every engine idle with no KV block in use and no
fair-share counter, the survivor with nothing in flight or outstanding, and the
tenant's concurrency leases back to zero once the dead gateway's expire.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import grpc
import pytest

from common.procs import ManagedProcess
from common.redis_server import RedisServer
from deploy.envoy import EnvoyProcess
from llm.v1 import gateway_pb2_grpc
from tests.integration.gateway.conftest import (
    EnginePair,
    GatewayProcess,
    envoy_over,
    start_gateway,
)
from tests.integration.gateway.test_gw_faults import STORY, engine_stats, wait_until

pytestmark = pytest.mark.integration
LEASE_TTL_MS = 3000  # a dead gateway's leases are reclaimed after this


@pytest.fixture
def fleet(
    engines: EnginePair,
    engine_server: ManagedProcess,
    tokenizer_server: ManagedProcess,
    gw_redis: RedisServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[EnvoyProcess, list[GatewayProcess], list[str]]]:
    engines.ensure_running()
    replicas = [*engines.addresses, engine_server.address]
    logs = tmp_path_factory.mktemp("fleet")
    env = {
        "LLM_RATELIMIT_KEY_PREFIX": "fleet:",
        "LLM_RATELIMIT_LEASE_TTL_MS": str(LEASE_TTL_MS),
        "LLM_RATELIMIT_AUTH_CACHE_TTL_MS": "500",
    }
    gws = [
        start_gateway(f"fleet-gw-{i}", replicas, tokenizer_server.address, gw_redis.url, logs, env)
        for i in range(2)
    ]
    envoy = envoy_over(gws, logs)
    try:
        yield envoy, gws, replicas
    finally:
        envoy.stop()
        for g in gws:
            g.stop()
        engines.ensure_running()  # the killed engine comes back for the other modules


def story(envoy: EnvoyProcess, key: str) -> tuple[str, int, str]:
    """One stream through Envoy: ("OK", tokens, "") or (status name, tokens before it,
    its message)."""
    n = 0
    with grpc.insecure_channel(envoy.listener_address()) as ch:
        try:
            for chunk in gateway_pb2_grpc.GatewayStub(ch).Generate(
                STORY, metadata=(("authorization", f"Bearer {key}"),), timeout=120
            ):
                n += len(chunk.token_ids)
        except grpc.RpcError as e:
            return e.code().name, n, (e.details() or "")[:160]  # type: ignore[attr-defined]
    return "OK", n, ""


def test_a_gateway_and_an_engine_die_under_load_and_nothing_is_left_behind(
    fleet: tuple[EnvoyProcess, list[GatewayProcess], list[str]], engines: EnginePair
) -> None:
    envoy, (gw0, gw1), replicas = fleet
    tenant, key = gw1.tenant(max_concurrent=64)
    with ThreadPoolExecutor(max_workers=12) as pool:
        first: list[Future[tuple[str, int, str]]] = [
            pool.submit(story, envoy, key) for _ in range(6)
        ]
        wait_until(lambda: gw0.metric("gateway_in_flight") >= 1, timeout=60)
        gw0.proc.signal(signal.SIGKILL)  # no drain: its clients' streams break
        # Envoy sees the dead gateway's connections close at once; a stream it forwarded
        # in that instant is one of the dead gateway's clients. Afterwards a new stream
        # finds gw0 refusing connections and is retried on gw1 (connect-failure)
        time.sleep(1.0)
        after = [pool.submit(story, envoy, key) for _ in range(4)]  # new: the survivor
        wait_until(lambda: gw1.metric("gateway_in_flight") >= 1, timeout=60)
        # an engine serving the survivor's streams dies: they fail over mid-stream
        wait_until(lambda: any(engine_stats(a).num_running for a in engines.addresses))
        victim = next(i for i, a in enumerate(engines.addresses) if engine_stats(a).num_running)
        engines.procs[victim].signal(signal.SIGKILL)
        outcomes = [f.result() for f in first]
        later = [f.result() for f in after]
    # the killed gateway's clients: a clear UNAVAILABLE, never another code or a hang;
    # everyone else: the whole story
    assert {o[0] for o in outcomes} <= {"OK", "UNAVAILABLE"}, outcomes
    assert "UNAVAILABLE" in {o[0] for o in outcomes}  # it was streaming when killed
    assert all(o[1] == 40 for o in outcomes if o[0] == "OK")
    assert later == [("OK", 40, "")] * 4, later  # the engine's death included
    # nothing left behind on the survivor and the live engines
    wait_until(lambda: gw1.metric("gateway_in_flight") == 0)
    assert gw1.metric("gateway_replica_outstanding") == 0
    live = [a for i, a in enumerate(replicas) if i != victim]

    def engines_idle() -> bool:
        stats = [engine_stats(a) for a in live]
        return all(
            s.num_running == s.num_waiting == s.num_kv_blocks_used == s.num_fair_share_tenants == 0
            for s in stats
        )

    wait_until(engines_idle)
    # the dead gateway never released its leases: reclaimed after their TTL
    time.sleep(LEASE_TTL_MS / 1000 + 1)
    assert gw1.usage(tenant).concurrent_in_use == 0
