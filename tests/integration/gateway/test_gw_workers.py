"""``[gateway] workers`` > 1: worker processes sharing one gateway's ports.

A real supervisor and its real workers over the suite's engines and Redis: both
workers take connections on the gRPC port the supervisor chose and on the HTTP port;
the supervisor's metrics port serves every worker's samples with a ``worker`` label;
a killed worker is started again on the same ports, and nothing stays behind when
the supervisor stops or dies.
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from common.procs import ManagedProcess
from common.redis_server import RedisServer
from llm.v1 import gateway_pb2_grpc
from tests.integration.gateway.conftest import (
    EnginePair,
    HttpGateway,
    chat,
    start_http_gateway,
)

pytestmark = pytest.mark.integration


def children(pid: int) -> set[int]:
    """The live child processes of ``pid`` (Linux /proc)."""
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return set()
    return {int(p) for p in text.split()}


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def kill_left(pids: set[int]) -> None:
    """SIGKILL those of ``pids`` (this test's workers) still running: stopping the
    supervisor's group misses them once the supervisor itself is gone."""
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def wait_for(cond: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def start_workers(
    name: str,
    engines: EnginePair,
    tokenizer_server: ManagedProcess,
    gw_redis: RedisServer,
    log_dir: Path,
) -> HttpGateway:
    return start_http_gateway(
        name,
        engines.addresses,
        tokenizer_server.address,
        gw_redis.url,
        log_dir,
        env={"LLM_GATEWAY_WORKERS": "2"},
    )


@pytest.fixture(scope="module")
def workers_gw(
    engines: EnginePair,
    tokenizer_server: ManagedProcess,
    gw_redis: RedisServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[HttpGateway]:
    engines.ensure_running()
    hg = start_workers(
        "gateway-workers", engines, tokenizer_server, gw_redis, tmp_path_factory.mktemp("gw-w")
    )
    try:
        yield hg
    finally:
        hg.gw.stop()


def port_file(hg: HttpGateway) -> dict[str, object]:
    path = hg.gw.proc.log_path.parent / f"{hg.gw.proc.name}.ports.json"
    data: dict[str, object] = json.loads(path.read_text())
    return data


def one_grpc_request_on_a_new_connection(address: str, key: str) -> int:
    """Tokens of one request made on a connection of its own (no shared subchannel)."""
    options = [("grpc.use_local_subchannel_pool", 1)]
    with grpc.insecure_channel(address, options=options) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        md = (("authorization", f"Bearer {key}"),)
        chunks = list(stub.Generate(chat("Say hi.", max_tokens=2), metadata=md, timeout=60))
    return sum(len(c.token_ids) for c in chunks)


def one_http_request(hg: HttpGateway, key: str) -> int:
    body = json.dumps({"prompt": "Say hi.", "max_tokens": 2}).encode()
    req = urllib.request.Request(
        f"{hg.base_url}/completions",
        data=body,
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as resp:  # a new connection each time
        return int(json.loads(resp.read())["usage"]["completion_tokens"])


def served_by_worker(hg: HttpGateway) -> dict[str, float]:
    """gateway_requests_total per worker label, from the supervisor's metrics port."""
    out: dict[str, float] = {}
    for line in hg.gw.metrics().splitlines():
        if line.startswith("gateway_requests_total{"):
            head, value = line.rsplit(" ", 1)
            worker = head.split('worker="', 1)[1].split('"', 1)[0]
            out[worker] = out.get(worker, 0.0) + float(value)
    return out


def test_both_workers_take_connections_on_both_ports(workers_gw: HttpGateway) -> None:
    hg = workers_gw
    ports = port_file(hg)
    assert ports["grpc"] == hg.gw.proc.port != 0  # the supervisor's own choice, reported
    assert ports["http"] == hg.http_port
    workers = ports["workers"]
    assert isinstance(workers, list)
    assert len(workers) == 2
    assert set(workers) <= children(hg.gw.proc.proc.pid)  # type: ignore[union-attr]
    tenant, key = hg.gw.tenant()
    before = served_by_worker(hg)
    # the kernel hashes each new connection to a worker: 40 connections all landing on
    # one of two workers would happen once in 2**39 runs
    made = 0
    for _ in range(40):
        assert one_grpc_request_on_a_new_connection(hg.gw.proc.address, key) == 2
        made += 1
        after = served_by_worker(hg)
        if all(after.get(w, 0) > before.get(w, 0) for w in ("0", "1")):
            break
    else:
        pytest.fail(f"one worker took every connection: {before} -> {after}")
    http_before = sum(served_by_worker(hg).values())
    assert [one_http_request(hg, key) for _ in range(4)] == [2, 2, 2, 2]
    assert sum(served_by_worker(hg).values()) == http_before + 4
    text = hg.gw.metrics()
    assert "gateway_workers_alive 2.0" in text
    # one tenant, one ledger in Redis, whichever worker served it; no lease left held
    usage = hg.gw.usage(tenant)
    assert usage.requests_total == made + 4
    assert usage.completion_tokens_total == 2 * (made + 4)
    assert usage.concurrent_in_use == 0


def test_a_killed_worker_is_started_again_on_the_same_ports(workers_gw: HttpGateway) -> None:
    hg = workers_gw
    supervisor = hg.gw.proc.proc.pid  # type: ignore[union-attr]
    old = children(supervisor)
    assert len(old) == 2
    victim = min(old)
    pids = port_file(hg)["workers"]
    assert isinstance(pids, list)
    index = pids.index(victim)  # the port file lists the first workers in index order
    os.kill(victim, signal.SIGKILL)
    wait_for(lambda: not alive(victim), 10, "the killed worker to exit")
    wait_for(
        lambda: len(children(supervisor)) == 2 and victim not in children(supervisor),
        30,
        "a new worker",
    )
    wait_for(
        lambda: (
            "gateway_workers_alive 2.0" in hg.gw.metrics()
            and f'process_start_time_seconds{{worker="{index}"}}' in hg.gw.metrics()
        ),
        60,
        "the new worker to serve its metrics",
    )
    text = hg.gw.metrics()
    restarts = [x for x in text.splitlines() if x.startswith("gateway_worker_restarts_total{")]
    assert restarts == [f'gateway_worker_restarts_total{{worker="{index}"}} 1.0']
    _, key = hg.gw.tenant()
    # new connections reach a serving worker whichever one the kernel picks
    assert [one_grpc_request_on_a_new_connection(hg.gw.proc.address, key) for _ in range(6)] == [
        2
    ] * 6
    assert [one_http_request(hg, key) for _ in range(3)] == [2, 2, 2]


@pytest.mark.parametrize(
    ("sig", "code"),
    [
        (signal.SIGTERM, 0),  # the supervisor forwards it and waits for the workers' drain
        (signal.SIGKILL, -signal.SIGKILL),  # no chance to forward: PR_SET_PDEATHSIG does
    ],
    ids=["stopped", "killed"],
)
def test_no_worker_outlives_its_supervisor(
    sig: signal.Signals,
    code: int,
    engines: EnginePair,
    tokenizer_server: ManagedProcess,
    gw_redis: RedisServer,
    tmp_path: Path,
) -> None:
    hg = start_workers(f"gateway-workers-{sig.name}", engines, tokenizer_server, gw_redis, tmp_path)
    supervisor = hg.gw.proc.proc
    assert supervisor is not None
    workers = children(supervisor.pid)
    assert len(workers) == 2
    supervisor.send_signal(sig)  # the supervisor only, not its process group
    try:
        assert supervisor.wait(timeout=30) == code
        wait_for(lambda: not any(alive(p) for p in workers), 30, "the workers to exit")
    finally:
        hg.gw.stop()
        kill_left(workers)
