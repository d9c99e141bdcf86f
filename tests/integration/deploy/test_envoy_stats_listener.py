"""The stats listener (what Prometheus and Kubernetes probes reach) exposes only two paths."""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from common.redis_server import free_port
from deploy.envoy import EnvoyProcess, render_config_file

pytestmark = pytest.mark.integration
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@pytest.fixture
def envoy_fixed_admin(tmp_path: Path) -> Iterator[EnvoyProcess]:
    # the stats listener proxies to the admin port, so that one must be known up front
    path = render_config_file(
        tmp_path / "envoy.yaml",
        listener_host="127.0.0.1",
        plaintext=True,  # loopback; TLS is tested in test_tls_envoy.py
        listener_port=0,
        admin_port=free_port(),
        stats_port=0,
        gateway=["127.0.0.1:1"],
        admin=["127.0.0.1:1"],
        access_log_path=tmp_path / "access.log",
    )
    with EnvoyProcess(path, log_dir=tmp_path) as envoy:
        yield envoy


def get(url: str) -> tuple[int, str]:
    try:
        with _OPENER.open(url, timeout=5) as resp:
            return int(resp.status), resp.read().decode()
    except urllib.error.HTTPError as err:
        return int(err.code), ""


def test_stats_listener_serves_metrics_and_ready_only(envoy_fixed_admin: EnvoyProcess) -> None:
    base = f"http://127.0.0.1:{envoy_fixed_admin.listener_port('stats')}"
    status, body = get(base + "/stats/prometheus")
    assert status == 200
    assert "envoy_cluster_upstream_rq_total" in body
    assert get(base + "/ready") == (200, "LIVE\n")
    for path in ("/clusters", "/quitquitquit", "/config_dump", "/stats"):
        assert get(base + path)[0] == 404, path
    assert envoy_fixed_admin.running  # /quitquitquit never reached the admin interface
