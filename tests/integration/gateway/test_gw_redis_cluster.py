"""Four real gateways sharing one tenant's limits through a real Redis Cluster.

The gateways run as ``python -m gateway`` with ``LLM_RATELIMIT_REDIS_CLUSTER=true``
and a seed of a 3-primary cluster (``common.redis_cluster``) that runs the stack's
ACL on every node; they connect as the service user with its password file, as
deployed. Authentication, the limiter, usage and the admin API all go through
redis-py's cluster client.
Threads call all four at once; the gateways together admit no more than the
tenant's bucket allows (+1), and each one reports the same shared totals.
"""

from __future__ import annotations

import contextlib
import secrets
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from common.procs import ManagedProcess
from common.redis_cluster import RedisClusterServers
from tests.integration.gateway.conftest import EnginePair, GatewayProcess, chat, start_gateway

pytestmark = pytest.mark.integration

RPM, BURST = 60, 6  # 1 request/s after a burst of 6


def cluster_env(cluster: RedisClusterServers, secrets_dir: Path) -> dict[str, str]:
    """A gateway's environment for ``cluster``: cluster mode, the service user, its
    password in a file under ``secrets_dir`` (as a mounted Secret)."""
    password_file = secrets_dir / "redis.password"
    password_file.write_text(cluster.password + "\n")
    return {
        "LLM_RATELIMIT_REDIS_CLUSTER": "true",
        "LLM_RATELIMIT_REDIS_USERNAME": cluster.username,
        "LLM_RATELIMIT_REDIS_PASSWORD_FILE": str(password_file),
    }


@pytest.fixture(scope="module")
def gateways(
    engines: EnginePair, tokenizer_server: ManagedProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[GatewayProcess]]:
    cluster = RedisClusterServers(password=secrets.token_hex(32))
    with contextlib.closing(cluster.start()):
        log_dir = tmp_path_factory.mktemp("gw-cluster")
        env = cluster_env(cluster, log_dir)

        def start(i: int) -> GatewayProcess:
            url = cluster.nodes[i % len(cluster.nodes)].server.url  # each from another seed
            return start_gateway(
                f"gw-cluster-{i}", engines.addresses, tokenizer_server.address, url, log_dir, env
            )

        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(start, i) for i in range(4)]
        gws = [f.result() for f in futures]
        try:
            yield gws
        finally:
            for gw in gws:
                gw.stop()


def hammer(gw: GatewayProcess, key: str, stop_at: float, out: list[str]) -> None:
    while time.monotonic() < stop_at:
        try:
            gw.generate(key, chat("hi", max_tokens=1), timeout=30)
            out.append("OK")
        except grpc.RpcError as err:
            out.append(err.code().name)  # type: ignore[attr-defined]
            time.sleep(0.01)


def test_four_gateways_on_a_cluster_share_one_bucket(gateways: list[GatewayProcess]) -> None:
    tenant, key = gateways[0].tenant(requests_per_minute=RPM, request_burst=BURST)
    outcomes: list[str] = []
    start = time.monotonic()
    threads = [
        threading.Thread(target=hammer, args=(gw, key, start + 4.0, outcomes))
        for gw in gateways
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - start
    admitted = outcomes.count("OK")
    print(
        f"\n4 gateways on a cluster, {elapsed:.1f} s: admitted {admitted} of {len(outcomes)}, "
        f"the bucket allows {BURST + elapsed * RPM / 60:.1f}"
    )
    assert set(outcomes) <= {"OK", "RESOURCE_EXHAUSTED"}, set(outcomes)
    assert outcomes.count("RESOURCE_EXHAUSTED") > 0  # they competed
    assert BURST <= admitted <= BURST + elapsed * RPM / 60 + 1
    # every gateway reads the same shared totals from the cluster
    totals = {gw.usage(tenant).requests_total for gw in gateways}
    assert totals == {admitted}
