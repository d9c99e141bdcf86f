"""The pieces of ``gateway.workers`` one at a time (the whole supervisor runs in
tests/integration/gateway/test_gw_workers.py)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest, start_http_server

from gateway.config import GatewayConfig
from gateway.workers import (
    GC_THRESHOLDS,
    SUPERVISOR_ENV,
    WORKER_ENV,
    Worker,
    WorkerMetrics,
    reserve_port,
)


def test_workers_must_be_positive() -> None:
    with pytest.raises(ValueError, match="workers must be > 0"):
        GatewayConfig(workers=0)
    assert GatewayConfig(workers=4).workers == 4


def test_a_reserved_port_is_shared_by_reuse_port_listeners_only() -> None:
    held = reserve_port("127.0.0.1", 0)
    port = held.getsockname()[1]
    try:
        assert port != 0
        with socket.socket() as plain, pytest.raises(OSError, match="in use"):
            plain.bind(("127.0.0.1", port))  # another program cannot take it
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        listener.bind(("127.0.0.1", port))
        listener.listen()
        try:
            # the held socket never listens: every connection reaches the listener
            for _ in range(20):
                with socket.create_connection(("127.0.0.1", port), timeout=2):
                    conn, _ = listener.accept()
                    conn.close()
        finally:
            listener.close()
    finally:
        held.close()


@pytest.fixture
def two_workers(tmp_path: Path) -> Iterator[list[Worker]]:
    """Two 'workers': this test's own metrics servers, each with a port file naming a
    live process of ours (a sleeping child) as its pid."""
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    servers = []
    workers = []
    try:
        for i in range(2):
            reg = CollectorRegistry()
            c = Counter("gateway_requests", "requests", ["code"], registry=reg)
            c.labels("OK").inc(i + 1)
            server, _ = start_http_server(0, addr="127.0.0.1", registry=reg)
            servers.append(server)
            w = Worker(i, tmp_path / f"w{i}.json", proc=sleeper)
            ports = {"grpc": 1, "metrics": server.server_port, "pid": sleeper.pid}
            w.port_file.write_text(json.dumps(ports))
            workers.append(w)
        yield workers
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()
        sleeper.kill()
        sleeper.wait()


def test_worker_metrics_are_merged_with_a_worker_label(two_workers: list[Worker]) -> None:
    reg = CollectorRegistry()
    reg.register(WorkerMetrics(two_workers, "127.0.0.1"))
    text = generate_latest(reg).decode()
    assert 'gateway_requests_total{code="OK",worker="0"} 1.0' in text
    assert 'gateway_requests_total{code="OK",worker="1"} 2.0' in text
    assert text.count("# TYPE gateway_requests_total counter") == 1  # one family, both workers


def test_a_worker_whose_port_file_is_a_predecessors_is_left_out(
    two_workers: list[Worker],
) -> None:
    stale = two_workers[1]
    data = json.loads(stale.port_file.read_text())
    stale.port_file.write_text(json.dumps({**data, "pid": data["pid"] + 1_000_000}))
    assert stale.ports() is None
    text = generate_latest(_registry(WorkerMetrics(two_workers, "0.0.0.0"))).decode()
    assert 'worker="0"' in text
    assert 'worker="1"' not in text


def _registry(collector: WorkerMetrics) -> CollectorRegistry:
    reg = CollectorRegistry()
    reg.register(collector)
    return reg


def _become(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    code = "from gateway.workers import become_worker; print(become_worker())"
    return subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_become_worker() -> None:
    env = {k: v for k, v in os.environ.items() if k != WORKER_ENV}
    plain = subprocess.run(
        [sys.executable, "-c", "from gateway.workers import become_worker; print(become_worker())"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert plain.stdout.strip() == "None"  # a plain gateway process
    # this test is the child's parent, so it is the child's supervisor
    ok = _become({WORKER_ENV: "3", SUPERVISOR_ENV: str(os.getpid())})
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.strip() == "3"
    orphan = _become({WORKER_ENV: "3", SUPERVISOR_ENV: str(os.getpid() + 1_000_000)})
    assert orphan.returncode == 1
    assert "supervisor exited before it started" in orphan.stderr


def test_settle_heap_freezes_start_up_objects_and_widens_the_young_generation() -> None:
    code = (
        "import gc; from gateway.workers import settle_heap; "
        "before = gc.get_freeze_count(); settle_heap(); "
        "print(before, gc.get_freeze_count() > 10_000, gc.get_threshold())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip().split(maxsplit=2) == ["0", "True", str(GC_THRESHOLDS)]
