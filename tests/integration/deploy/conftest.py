"""A real Envoy in front of the standalone RateLimitAdmin service (and a real Redis).

Redis and ``python -m ratelimit`` start once for this package, Envoy once
per module, on ephemeral ports, and are stopped by pid afterwards.

    client ──► Envoy (public listener, port 0) ──► ratelimit (RateLimitAdmin, port 0) ──► Redis
                 │ cluster "admin": the ratelimit service
                 └ cluster "gateway": a port nothing listens on (no gateway yet)
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from common.procs import ManagedProcess
from common.redis_server import RedisServer, free_port
from deploy.envoy import EnvoyProcess, render_config_file

ADMIN_KEY = "sk-llm-admin-" + uuid.uuid4().hex


@dataclass(slots=True)
class Edge:
    envoy: EnvoyProcess
    ratelimit: ManagedProcess
    access_log: Path
    config_path: Path
    dead_gateway_port: int

    @property
    def address(self) -> str:
        return self.envoy.listener_address()

    @property
    def http_url(self) -> str:
        return f"http://{self.address}"

    def access_log_lines(self) -> list[str]:
        return [ln for ln in self.access_log.read_text().splitlines() if ln.strip()]


@pytest.fixture(scope="package")
def edge_redis() -> Iterator[RedisServer]:
    server = RedisServer().start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="package")
def ratelimit_server(
    edge_redis: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ManagedProcess]:
    proc = ManagedProcess(
        name="ratelimit",
        module="ratelimit",
        args=[
            "--port",
            "0",
            "--metrics-port",
            "-1",
            "--redis-url",
            edge_redis.url,
            "--key-prefix",
            f"edge{uuid.uuid4().hex[:8]}:",
            "--log-format",
            "json",
        ],
        env={"ADMIN_KEY": ADMIN_KEY},
        log_dir=tmp_path_factory.mktemp("ratelimit-logs"),
    )
    proc.start(timeout=60)
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def edge(
    ratelimit_server: ManagedProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Edge]:
    workdir = tmp_path_factory.mktemp("envoy")
    access_log = workdir / "access.log"
    access_log.touch()
    dead_port = free_port()
    config_path = render_config_file(
        workdir / "envoy.yaml",
        listener_host="127.0.0.1",
        plaintext=True,  # loopback; TLS is tested in test_tls_envoy.py
        listener_port=0,
        admin_port=0,
        gateway=[f"127.0.0.1:{dead_port}"],
        admin=[ratelimit_server.address],
        access_log_path=access_log,
    )
    envoy = EnvoyProcess(config_path, log_dir=workdir, file_flush_interval_ms=50)
    envoy.start(timeout=30)
    try:
        yield Edge(envoy, ratelimit_server, access_log, config_path, dead_port)
    finally:
        envoy.stop()
