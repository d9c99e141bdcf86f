"""The engine port's TLS settings (``common.service_auth.read_server_tls``) and the bind
(``common.server.bind``): a real loopback server with the local CA, no model."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common.server import bind
from common.service_auth import ServerTls, read_server_tls
from deploy.envoy.tls import TlsFiles, ensure_local_tls


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    return ensure_local_tls(tmp_path_factory.mktemp("tls"))


def test_no_setting_is_plaintext() -> None:
    assert read_server_tls("", "", "") is None


def test_half_a_configuration_is_refused(tls: TlsFiles, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="go together"):
        read_server_tls(str(tls.cert), "", "")
    with pytest.raises(ValueError, match="go together"):
        read_server_tls("", "", str(tls.ca_cert))
    with pytest.raises(ValueError, match=r"tls_client_ca_file .* does not exist"):
        read_server_tls(str(tls.cert), str(tls.key), str(tmp_path / "missing.crt"))
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate")
    with pytest.raises(ValueError, match=r"tls_cert_file .* holds no PEM block"):
        read_server_tls(str(junk), str(tls.key), "")


def test_the_files_are_read(tls: TlsFiles) -> None:
    server = read_server_tls(str(tls.cert), str(tls.key), "")
    assert server == ServerTls(tls.cert.read_bytes(), tls.key.read_bytes())
    assert not server.mutual
    mutual = read_server_tls(str(tls.cert), str(tls.key), str(tls.ca_cert))
    assert mutual is not None
    assert mutual.mutual


async def _health_over(tls_files: TlsFiles, server_tls: ServerTls | None, creds: object) -> str:
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)  # type: ignore[attr-defined]
    port = bind(server, "127.0.0.1:0", server_tls)
    assert port
    await server.start()
    try:
        target = f"localhost:{port}"
        ch = (
            grpc.aio.insecure_channel(target)
            if creds is None
            else grpc.aio.secure_channel(target, creds)  # type: ignore[arg-type]
        )
        async with ch:
            try:
                r = await health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(), timeout=5
                )
                return str(health_pb2.HealthCheckResponse.ServingStatus.Name(r.status))
            except grpc.aio.AioRpcError as e:
                return str(e.code().name)
    finally:
        await server.stop(0)


def test_server_tls_and_plaintext_ports(tls: TlsFiles) -> None:
    trust = grpc.ssl_channel_credentials(root_certificates=tls.ca_cert.read_bytes())
    server = read_server_tls(str(tls.cert), str(tls.key), "")
    assert asyncio.run(_health_over(tls, server, trust)) == "SERVING"
    assert asyncio.run(_health_over(tls, server, None)) == "UNAVAILABLE"
    assert asyncio.run(_health_over(tls, None, None)) == "SERVING"


def test_mutual_tls_needs_a_client_certificate(tls: TlsFiles) -> None:
    mutual = read_server_tls(str(tls.cert), str(tls.key), str(tls.ca_cert))
    no_cert = grpc.ssl_channel_credentials(root_certificates=tls.ca_cert.read_bytes())
    assert asyncio.run(_health_over(tls, mutual, no_cert)) == "UNAVAILABLE"
