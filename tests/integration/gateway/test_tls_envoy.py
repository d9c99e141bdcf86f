"""TLS at the edge: a real Envoy (deploy/envoy/envoy.yaml, its TLS listener as written)
in front of the real gateway, with a local CA and certificate from deploy/envoy/tls.py.

Clients that trust the CA get gRPC (ALPN h2), the OpenAI HTTP front and the admin
HTTP/JSON API; a client that does not trust it, plaintext, and TLS below 1.2 are
refused at the handshake.
"""

from __future__ import annotations

import json
import os
import socket
import ssl
import subprocess
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx2
import openai
import pytest

from bench.loadlib.runner import Endpoint
from bench.loadlib.spawn import setup_tenants
from bench.loadlib.workload import RequestSpec, TenantSpec
from common.config import ROOT
from deploy.envoy import EnvoyProcess
from deploy.envoy.tls import TlsFiles, ensure_local_tls
from llm.v1 import admin_pb2, admin_pb2_grpc, gateway_pb2_grpc
from tests.integration.gateway.conftest import ADMIN_KEY, HttpGateway, chat
from tests.unit.deploy.helpers import OPENSSL_WHY, require_tool

pytestmark = pytest.mark.integration


@dataclass(slots=True)
class TlsEdge:
    envoy: EnvoyProcess
    tls: TlsFiles
    key: str  # a tenant's API key
    tenant: str

    @property
    def port(self) -> int:
        return self.envoy.listener_port()

    def trusting(self, ca: Path | None = None) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=ca or self.tls.ca_cert)


@pytest.fixture(scope="module")
def edge(http_gateway: HttpGateway, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsEdge]:
    require_tool("openssl", OPENSSL_WHY)
    workdir = tmp_path_factory.mktemp("envoy-tls")
    tls = ensure_local_tls(workdir / "tls")
    # TLS as envoy.yaml has it; only the certificate and key are this test's
    path = http_gateway.envoy_config(workdir, tls_cert=tls.cert, tls_key=tls.key)
    tenant, key = http_gateway.gw.tenant()
    with EnvoyProcess(path, log_dir=workdir) as envoy:
        yield TlsEdge(envoy, tls, key, tenant)


def generate(channel: grpc.Channel, key: str) -> list[object]:
    stub = gateway_pb2_grpc.GatewayStub(channel)
    md = (("authorization", f"Bearer {key}"),)
    return list(stub.Generate(chat("Hi", max_tokens=3), metadata=md, timeout=60))


def test_grpc_with_the_ca_trusted_streams_through_envoy(edge: TlsEdge) -> None:
    creds = grpc.ssl_channel_credentials(root_certificates=edge.tls.ca_cert.read_bytes())
    for host in ("localhost", "127.0.0.1"):  # the certificate's DNS and IP names
        with grpc.secure_channel(f"{host}:{edge.port}", creds) as ch:
            chunks = generate(ch, edge.key)
            assert chunks[-1].usage.completion_tokens == 3  # type: ignore[attr-defined]
            tenant = admin_pb2_grpc.RateLimitAdminStub(ch).GetTenant(
                admin_pb2.GetTenantRequest(tenant_id=edge.tenant),
                metadata=(("authorization", f"Bearer {ADMIN_KEY}"),),
                timeout=10,
            )
            assert tenant.id == edge.tenant


def test_a_client_that_does_not_trust_the_ca_fails_the_handshake(
    edge: TlsEdge, tmp_path: Path
) -> None:
    other = ensure_local_tls(tmp_path / "other")  # a CA that did not sign Envoy's certificate
    for creds in (
        grpc.ssl_channel_credentials(),  # gRPC's own public roots
        grpc.ssl_channel_credentials(root_certificates=other.ca_cert.read_bytes()),
    ):
        with grpc.secure_channel(f"localhost:{edge.port}", creds) as ch:
            with pytest.raises(grpc.RpcError) as err:
                generate(ch, edge.key)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    for ctx in (ssl.create_default_context(), edge.trusting(other.ca_cert)):
        with (
            pytest.raises(ssl.SSLCertVerificationError, match="unable to get local issuer"),
            socket.create_connection(("127.0.0.1", edge.port), timeout=10) as raw,
            ctx.wrap_socket(raw, server_hostname="localhost"),
        ):
            pass
    # trusting the CA, but asking for a name the certificate does not carry
    with (
        pytest.raises(ssl.SSLCertVerificationError, match="mismatch"),
        socket.create_connection(("127.0.0.1", edge.port), timeout=10) as raw,
        edge.trusting().wrap_socket(raw, server_hostname="llm.example.com"),
    ):
        pass


def test_plaintext_to_the_tls_port_gets_no_answer(edge: TlsEdge) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{edge.port}") as ch:
        with pytest.raises(grpc.RpcError) as err:
            generate(ch, edge.key)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    with socket.create_connection(("127.0.0.1", edge.port), timeout=10) as raw:
        raw.sendall(b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\n\r\n")
        try:
            answer = raw.recv(4096)
        except ConnectionResetError:
            answer = b""
    assert not answer.startswith(b"HTTP/")  # Envoy closes: no HTTP over this port


def test_alpn_offers_h2_and_http1_and_tls_below_1_2_is_refused(edge: TlsEdge) -> None:
    def connect(ctx: ssl.SSLContext) -> tuple[str | None, str | None, str | None]:
        with (
            socket.create_connection(("127.0.0.1", edge.port), timeout=10) as raw,
            ctx.wrap_socket(raw, server_hostname="localhost") as tls,
        ):
            cipher = tls.cipher()
            return tls.version(), tls.selected_alpn_protocol(), cipher[0] if cipher else None

    ctx = edge.trusting()
    ctx.set_alpn_protocols(["h2", "http/1.1"])
    version, alpn, _ = connect(ctx)
    assert (version, alpn) == ("TLSv1.3", "h2")
    ctx = edge.trusting()
    ctx.set_alpn_protocols(["http/1.1"])
    ctx.maximum_version = ssl.TLSVersion.TLSv1_2
    version, alpn, cipher = connect(ctx)
    assert (version, alpn) == ("TLSv1.2", "http/1.1")
    assert cipher is not None
    assert cipher.startswith("ECDHE-")
    # a client that offers TLS 1.1 at most: Envoy answers with a protocol_version alert
    old = edge.trusting()
    old.set_ciphers("DEFAULT:@SECLEVEL=0")  # let this OpenSSL offer 1.1 at all
    with warnings.catch_warnings():  # an outdated client on purpose
        warnings.simplefilter("ignore", DeprecationWarning)
        old.minimum_version = old.maximum_version = ssl.TLSVersion.TLSv1_1
    with pytest.raises(ssl.SSLError, match="alert protocol version"):
        connect(old)


def test_openai_sdk_and_admin_http_json_over_tls(edge: TlsEdge) -> None:
    base = f"https://localhost:{edge.port}"
    http_client = openai.DefaultHttpxClient(verify=edge.trusting())
    with openai.OpenAI(
        base_url=base + "/v1", api_key=edge.key, http_client=http_client, max_retries=0
    ) as client:
        stream = client.chat.completions.create(
            model="",
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=4,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        assert chunks[-1].usage is not None
        assert 0 < chunks[-1].usage.completion_tokens <= 4
    with httpx2.Client(verify=edge.trusting(), timeout=10) as h:
        resp = h.get(
            f"{base}/v1/admin/tenants/{edge.tenant}",
            headers={"authorization": f"Bearer {ADMIN_KEY}"},
        )
        assert resp.status_code == 200, resp.text
        assert resp.json()["id"] == edge.tenant
        assert resp.http_version == "HTTP/1.1"
    with (
        httpx2.Client(timeout=10) as untrusting,  # the system's roots
        pytest.raises(httpx2.ConnectError, match="CERTIFICATE_VERIFY_FAILED"),
    ):
        untrusting.get(f"{base}/v1/models")


def test_curl_streams_over_http2_with_the_ca(edge: TlsEdge) -> None:
    body = json.dumps({"model": "", "prompt": "Once", "max_tokens": 4, "stream": True})
    cmd = ["curl", "-sS", "-N", "-i", "--max-time", "60", "--cacert", str(edge.tls.ca_cert)]
    cmd += ["-H", f"Authorization: Bearer {edge.key}", "-H", "Content-Type: application/json"]
    cmd += ["-d", body, f"https://localhost:{edge.port}/v1/completions"]
    out = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("HTTP/2 200")  # h2 by ALPN
    assert out.stdout.rstrip().endswith("data: [DONE]")
    refused = subprocess.run(
        ["curl", "-sS", "--max-time", "10", f"https://localhost:{edge.port}/v1/models"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert refused.returncode == 60, refused.stderr  # curl's "peer certificate not trusted"


def cli(edge: TlsEdge, run_dir: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LLM_RUN_DIR": str(run_dir)}
    env["LLM_API_KEY"] = edge.key
    env.pop("LLM_CA_CERT", None)
    cmd = [sys.executable, "-m", "llm_client", "--address", f"localhost:{edge.port}"]
    return subprocess.run(
        [*cmd, *flags, "chat", "Hi", "--max-tokens", "3"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_the_cli_talks_tls(edge: TlsEdge, tmp_path: Path) -> None:
    ok = cli(edge, tmp_path, "--ca-cert", str(edge.tls.ca_cert))
    assert ok.returncode == 0, ok.stderr
    assert "completion 3" in ok.stderr
    # nothing to trust but the public roots: the handshake fails
    untrusted = cli(edge, tmp_path)
    assert untrusted.returncode == 1
    assert "error: UNAVAILABLE" in untrusted.stderr
    plain = cli(edge, tmp_path, "--plaintext")
    assert plain.returncode == 1
    assert "error: UNAVAILABLE" in plain.stderr


async def test_the_load_tool_creates_tenants_and_streams_over_tls(edge: TlsEdge) -> None:
    """bench.load --target envoy --ca-cert: tenants through the admin API, then a stream."""
    address, ca = f"localhost:{edge.port}", edge.tls.ca_cert.read_bytes()
    tenant = TenantSpec(name="tls-load")
    setup_tenants(address, ADMIN_KEY, [tenant], f"-{os.getpid()}", ca_cert=ca)
    assert tenant.key.startswith("sk-llm-")
    endpoint = Endpoint("envoy", address, ca_cert=ca)
    target = endpoint.target([tenant])
    spec = RequestSpec(0, tenant.name, tenant.priority_value, "chat", "Hi", [], 3)
    try:
        tokens = [n async for n, _, _ in target.stream(spec, timeout_s=60)]
    finally:
        await target.close()
    assert sum(tokens) == 3
