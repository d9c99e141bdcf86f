"""``python -m ratelimit`` as a real subprocess: health, reflection, admin call, SIGTERM."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from common.procs import ManagedProcess, check_health
from common.redis_server import RedisServer
from llm.v1 import admin_pb2, admin_pb2_grpc
from ratelimit.admin.servicer import SERVICE_NAME

pytestmark = pytest.mark.integration
ADMIN_KEY = "sk-llm-admin-key-for-the-subprocess-test-01"


@pytest.fixture
def service(redis_server: RedisServer, tmp_path: Path, prefix: str) -> Iterator[ManagedProcess]:
    key_file = tmp_path / "admin.key"
    key_file.write_text(ADMIN_KEY + "\n")
    proc = ManagedProcess(
        name="ratelimit",
        module="ratelimit",
        args=[
            "--port",
            "0",
            "--metrics-port",
            "-1",
            "--redis-url",
            redis_server.url,
            "--key-prefix",
            prefix,
            "--admin-key-file",
            str(key_file),
            "--log-format",
            "json",
        ],
        log_dir=tmp_path,
    )
    proc.start(timeout=60)
    try:
        yield proc
    finally:
        proc.stop()


def test_standalone_service(service: ManagedProcess) -> None:
    assert check_health(service.address, SERVICE_NAME)
    with grpc.insecure_channel(service.address) as channel:
        refl = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = refl.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")])
        )
        names = {s.name for r in replies for s in r.list_services_response.service}
        assert SERVICE_NAME in names
        stub = admin_pb2_grpc.RateLimitAdminStub(channel)
        auth = (("authorization", f"Bearer {ADMIN_KEY}"),)
        stub.UpsertTenant(admin_pb2.Tenant(id="demo"), metadata=auth)
        listed = stub.ListTenants(admin_pb2.ListTenantsRequest(), metadata=auth)
        assert [t.id for t in listed.tenants] == ["demo"]
    assert service.stop() == 0
