"""Envoy's admin interface is a unix socket only Envoy's user may open, and its logs
are readable by that user only (a real Envoy): /quitquitquit, /logging (debug logs
carry bearer keys) and /runtime_modify are out of every network client's reach."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from deploy.envoy import EnvoyProcess, render_config_file

pytestmark = pytest.mark.integration


@pytest.fixture
def envoy(tmp_path: Path) -> Iterator[EnvoyProcess]:
    path = render_config_file(
        tmp_path / "envoy.yaml",
        listener_host="127.0.0.1",
        plaintext=True,  # loopback; TLS is tested in test_tls_envoy.py
        listener_port=0,
        admin_port=0,  # the old way to ask for an admin interface of its own
        stats_port=0,
        gateway=["127.0.0.1:1"],
        admin=["127.0.0.1:1"],
        access_log_path=tmp_path / "access.log",
    )
    with EnvoyProcess(path, log_dir=tmp_path) as proc:
        yield proc
    assert not proc.admin_socket.parent.exists()  # a private socket leaves nothing behind


def mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


def test_the_admin_interface_is_a_0600_unix_socket_and_the_logs_are_0600(
    envoy: EnvoyProcess, tmp_path: Path
) -> None:
    assert envoy.admin_address == f"unix:{envoy.admin_socket}"
    assert mode(envoy.admin_socket) == 0o600
    assert mode(envoy.admin_socket.parent) == 0o700  # a directory of its own
    assert mode(envoy.log_path) == 0o600
    assert mode(tmp_path / "access.log") == 0o600
    # it works for its owner: stats, and the stats listener proxies /ready to it
    assert envoy.admin_get("/ready") == (200, "LIVE\n")
    assert "server.live" in envoy.stats("server.live")
    stats_port = envoy.listener_port("stats")
    with socket.create_connection(("127.0.0.1", stats_port), timeout=5) as conn:
        # the containers' health check asks exactly this
        conn.sendall(b"GET /ready HTTP/1.1\r\nHost: envoy\r\nConnection: close\r\n\r\n")
        assert conn.recv(64).startswith(b"HTTP/1.1 200")
    # no TCP port of this Envoy is the admin interface: the listeners are its only ports
    _, body = envoy.admin_get("/listeners?format=json")
    names = {item["name"] for item in json.loads(body)["listener_statuses"]}
    assert names == {"public", "stats"}
    for port in envoy.listener_ports.values():
        with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
            conn.sendall(b"POST /quitquitquit HTTP/1.1\r\nHost: e\r\nConnection: close\r\n\r\n")
            assert b" 200 " not in conn.recv(64).split(b"\r\n", 1)[0]
    assert envoy.running
