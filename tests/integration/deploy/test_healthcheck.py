"""deploy/healthcheck.py (the containers' HEALTHCHECK) against a real service."""

from __future__ import annotations

import pytest

from common.procs import ManagedProcess
from common.redis_server import free_port
from deploy import healthcheck

pytestmark = pytest.mark.integration


def test_serving_service_exits_0(ratelimit_server: ManagedProcess) -> None:
    assert healthcheck.main([ratelimit_server.address]) == 0
    assert healthcheck.main([ratelimit_server.address, "llm.v1.RateLimitAdmin"]) == 0


def test_unknown_service_or_dead_port_exits_1(
    ratelimit_server: ManagedProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    assert healthcheck.main([ratelimit_server.address, "llm.v1.NoSuchService"]) == 1
    assert "NOT_FOUND" in capsys.readouterr().err
    assert healthcheck.main([f"127.0.0.1:{free_port()}"]) == 1
    assert "UNAVAILABLE" in capsys.readouterr().err


def test_usage_error_exits_2() -> None:
    assert healthcheck.main([]) == 2
