"""The request path through a Redis Cluster failover: never INTERNAL.

A real gateway (``python -m gateway``) on a real 3-primary cluster with the
stack's ACL, its key cache off (``auth_cache_ttl_ms: 0``: every call reads the
key and its tenant from Redis). Threads call ListModels (authentication alone)
and Generate (authentication, limiter, engine, settle) with keys of tenants on
every shard while the primary holding one of the keys is SIGKILLed and its
replica promoted. Connections closed under a call make redis-py leak
AttributeError/TypeError besides its own errors; every call must end OK or with
UNAVAILABLE and a message that says to retry (RESOURCE_EXHAUSTED only from the
limits), in both fail modes, and calls succeed again after the promotion.
"""

from __future__ import annotations

import contextlib
import random
import secrets
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from common.procs import ManagedProcess
from common.redis_cluster import RedisClusterServers
from llm.v1 import gateway_pb2
from ratelimit.tenancy.records import hash_key
from tests.integration.gateway.conftest import EnginePair, GatewayProcess, chat, start_gateway
from tests.integration.gateway.test_gw_redis_cluster import cluster_env

pytestmark = pytest.mark.integration

NUM_TENANTS = 12


class Calls:
    """Every call's outcome, and the UNAVAILABLE messages (thread-safe)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.codes: Counter[str] = Counter()
        self.unavailable: set[str] = set()
        self.ok_since_mark = 0

    def add(self, code: str, details: str = "") -> None:
        with self.lock:
            self.codes[code] += 1
            if code == "UNAVAILABLE":
                self.unavailable.add(details)
            if code == "OK":
                self.ok_since_mark += 1

    def mark(self) -> None:
        with self.lock:
            self.ok_since_mark = 0


def call_forever(gw: GatewayProcess, keys: list[str], calls: Calls, stop: threading.Event) -> None:
    rng = random.Random()
    while not stop.is_set():
        key = rng.choice(keys)
        md = (("authorization", f"Bearer {key}"),)
        try:
            if rng.random() < 0.8:
                gw.stub.ListModels(gateway_pb2.ListModelsRequest(), metadata=md, timeout=30)
            else:
                gw.generate(key, chat("hi", max_tokens=1), timeout=30)
            calls.add("OK")
        except grpc.RpcError as err:
            calls.add(err.code().name, err.details() or "")  # type: ignore[attr-defined]
            time.sleep(0.005)


@pytest.fixture(params=["open", "closed"])
def gateway_on_cluster(
    request: pytest.FixtureRequest,
    engines: EnginePair,
    tokenizer_server: ManagedProcess,
    tmp_path: Path,
) -> Iterator[tuple[GatewayProcess, RedisClusterServers]]:
    cluster = RedisClusterServers(password=secrets.token_hex(32), node_timeout_ms=1000)
    with contextlib.closing(cluster.start()):
        env = {
            **cluster_env(cluster, tmp_path),
            "LLM_RATELIMIT_AUTH_CACHE_TTL_MS": "0",  # every call a key-cache miss
            "LLM_RATELIMIT_FAIL_MODE": str(request.param),
            "LLM_RATELIMIT_TIMEOUT_MS": "200",
        }
        gw = start_gateway(
            f"gw-failover-{request.param}",
            engines.addresses,
            tokenizer_server.address,
            cluster.url,
            tmp_path,
            env,
        )
        try:
            yield gw, cluster
        finally:
            gw.stop()


def test_no_internal_error_while_a_primary_fails_over(
    gateway_on_cluster: tuple[GatewayProcess, RedisClusterServers],
) -> None:
    gw, cluster = gateway_on_cluster
    keys = [gw.tenant(requests_per_minute=6000)[1] for _ in range(NUM_TENANTS)]
    key_records = [f"rl:key:{hash_key(k)}" for k in keys]
    assert len({cluster.primary_of(k) for k in key_records}) > 1  # keys on several shards
    cluster.wait_replicated()
    calls, stop = Calls(), threading.Event()
    threads = [
        threading.Thread(target=call_forever, args=(gw, keys, calls, stop)) for _ in range(6)
    ]
    for t in threads:
        t.start()
    try:

        def wait_ok(n: int) -> None:
            deadline = time.monotonic() + 60
            while calls.ok_since_mark < n and time.monotonic() < deadline:
                time.sleep(0.02)
            assert calls.ok_since_mark >= n, calls.codes

        wait_ok(50)  # under load on a healthy cluster
        dead = cluster.kill_primary_of(key_records[0])
        killed_at = sum(calls.codes.values())
        cluster.wait_promoted(key_records[0], dead)
        calls.mark()
        wait_ok(100)  # the gateway uses the promoted replica by itself
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
    print(
        f"\nfailover under key-cache misses: {dict(calls.codes)} "
        f"({sum(calls.codes.values()) - killed_at} calls after the kill)"
    )
    assert "INTERNAL" not in calls.codes, calls.codes
    assert set(calls.codes) <= {"OK", "UNAVAILABLE", "RESOURCE_EXHAUSTED"}, calls.codes
    for message in calls.unavailable:
        assert "retry" in message, message
    assert gw.proc.running
