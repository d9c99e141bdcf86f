"""No unauthenticated engine port: the standard protocols sit behind the same gates as
llm.v1.Engine. With a service token, a call without it is UNAUTHENTICATED on every
service; with mutual TLS (the stack's local CA from deploy/envoy/tls.py, plus a client
certificate it issues here), a caller without a certificate signed by that CA fails the
handshake, and one with it needs no token. Real engines, real model, loopback."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import ssl
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from smg_grpc_proto.generated import (
    sglang_scheduler_pb2_grpc,
    trtllm_service_pb2,
    trtllm_service_pb2_grpc,
    vllm_engine_pb2,
    vllm_engine_pb2_grpc,
)

from common.config import ROOT
from common.procs import ManagedProcess, check_health
from common.service_auth import SERVICE_TOKEN_KEY
from deploy.envoy.tls import TlsFiles, ensure_local_tls, openssl
from llm.v1 import engine_pb2, engine_pb2_grpc
from tests.conftest import ENGINE_TEST_ENV
from tests.integration.engine.test_standard_sglang import sgl_request
from tests.integration.engine.test_standard_vllm import PROMPT, vllm_request
from tests.unit.deploy.helpers import OPENSSL_WHY, require_tool

# an engine start measures its kernels first: minutes on a loaded machine
pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

FAST_START = {"LLM_ENGINE_WARMUP": "false", "LLM_ENGINE_CORE_NUM_KV_BLOCKS": "128"}


@dataclass(frozen=True)
class Pki:
    """The local CA (server certificate for localhost / 127.0.0.1) and client
    certificates: one it signed, one another CA signed."""

    tls: TlsFiles
    client_cert: Path
    client_key: Path
    stranger_cert: Path
    stranger_key: Path


def issue_client_cert(ca: TlsFiles, out: Path, name: str) -> tuple[Path, Path]:
    """A client certificate (extendedKeyUsage clientAuth) signed by ``ca``'s CA."""
    key, csr, cert, ext = (out / f"{name}.{s}" for s in ("key", "csr", "crt", "cnf"))
    ext.write_text(
        "basicConstraints = critical,CA:FALSE\nkeyUsage = critical,digitalSignature\n"
        "extendedKeyUsage = clientAuth\n"
    )
    openssl(
        "req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
        "-keyout", key, "-out", csr, "-subj", f"/O=llm-serving-stack/CN={name}",
    )  # fmt: skip
    openssl(
        "x509", "-req", "-in", csr, "-CA", ca.ca_cert, "-CAkey", ca.ca_key,
        "-set_serial", f"0x{secrets.token_hex(16)}", "-days", "2", "-sha256",
        "-extfile", ext, "-out", cert,
    )  # fmt: skip
    return cert, key


def make_pki(root: Path) -> Pki:
    require_tool("openssl", OPENSSL_WHY)
    tls = ensure_local_tls(root / "tls")
    cert, key = issue_client_cert(tls, root, "gateway")
    other = ensure_local_tls(root / "other")
    stranger, stranger_key = issue_client_cert(other, root, "stranger")
    return Pki(tls, cert, key, stranger, stranger_key)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def mtls_credentials(pki: Pki, cert: Path | None, key: Path | None) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=pki.tls.ca_cert.read_bytes(),
        private_key=key.read_bytes() if key else None,
        certificate_chain=cert.read_bytes() if cert else None,
    )


def tls_health(pki: Pki) -> Callable[[str], bool]:
    """A readiness check over mutual TLS (plaintext health probes cannot reach the port)."""

    def healthy(address: str) -> bool:
        creds = mtls_credentials(pki, pki.client_cert, pki.client_key)
        with grpc.secure_channel(address, creds) as ch:
            try:
                resp = health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(), timeout=2
                )
            except grpc.RpcError:
                return False
        return bool(resp.status == health_pb2.HealthCheckResponse.SERVING)

    return healthy


@contextlib.contextmanager
def engine_process(
    name: str,
    model_dir: Path,
    log_dir: Path,
    args: list[str],
    healthy: Callable[[str], bool],
    timeout: float = 420,
) -> Iterator[ManagedProcess]:
    """A real engine (fast start: no warm-up, a small pool), ready once ``healthy``
    answers for its address; stopped at the end. The start may take minutes on a
    loaded machine (the engine measures its kernels first)."""
    proc = ManagedProcess(name=name, module="engine_svc", log_dir=log_dir)
    port_file = log_dir / f"{name}.ports.json"
    cmd = [
        sys.executable, "-m", "engine_svc", "--port", "0", "--metrics-port", "-1",
        "--model-dir", str(model_dir), "--log-format", "json", "--port-file", str(port_file),
        *args,
    ]  # fmt: skip
    env = {**os.environ, **ENGINE_TEST_ENV, **FAST_START, "PYTHONUNBUFFERED": "1"}
    env.setdefault("PYTHONPATH", str(ROOT))
    proc.spawn(cmd, cwd=ROOT, env=env)

    def ready() -> bool:
        if not port_file.exists():
            return False
        proc.port = int(json.loads(port_file.read_text())["grpc"])
        return healthy(proc.address)

    try:
        proc.wait_ready(ready, timeout, poll_s=0.2)
        yield proc
    finally:
        proc.stop()


def mtls_args(pki: Pki) -> list[str]:
    """The engine flags of a mutual-TLS port with the local CA."""
    return [
        "--tls-cert-file", str(pki.tls.cert), "--tls-key-file", str(pki.tls.key),
        "--tls-client-ca-file", str(pki.tls.ca_cert),
    ]  # fmt: skip


@pytest.fixture(scope="module")
def token_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("token") / "service.token"
    path.write_text(secrets.token_hex(32))
    return path


@pytest.fixture(scope="module")
def mtls(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory, pki: Pki, token_file: Path
) -> Iterator[ManagedProcess]:
    # a token too: under mutual TLS the certificate stands for it
    args = [*mtls_args(pki), "--service-token-file", str(token_file)]
    logs = tmp_path_factory.mktemp("mtls-logs")
    with engine_process("engine-mtls", model_dir, logs, args, tls_health(pki)) as proc:
        yield proc


@pytest.fixture(scope="module")
def tokened(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory, token_file: Path
) -> Iterator[ManagedProcess]:
    args = ["--service-token-file", str(token_file)]
    logs = tmp_path_factory.mktemp("token-logs")
    with engine_process("engine-token", model_dir, logs, args, check_health) as proc:
        yield proc


def trt_request(rid: str) -> trtllm_service_pb2.GenerateRequest:
    return trtllm_service_pb2.GenerateRequest(
        request_id=rid,
        tokenized=trtllm_service_pb2.TokenizedInput(input_token_ids=PROMPT),
        max_tokens=2,
        streaming=True,
    )


def every_service(channel: grpc.Channel, metadata: Any = ()) -> dict[str, grpc.StatusCode]:
    """One call to each engine service on ``channel``: OK or the status it ended with."""
    calls: dict[str, Callable[[], object]] = {
        "llm.v1.Engine": lambda: engine_pb2_grpc.EngineStub(channel).GetStats(
            engine_pb2.GetStatsRequest(), metadata=metadata, timeout=30
        ),
        "VllmEngine.Generate": lambda: list(
            vllm_engine_pb2_grpc.VllmEngineStub(channel).Generate(
                vllm_request(f"auth-v-{secrets.token_hex(4)}", PROMPT, 2),
                metadata=metadata,
                timeout=60,
            )
        ),
        "VllmEngine.GetLoads": lambda: vllm_engine_pb2_grpc.VllmEngineStub(channel).GetLoads(
            vllm_engine_pb2.GetLoadsRequest(), metadata=metadata, timeout=30
        ),
        "TrtllmService.Generate": lambda: list(
            trtllm_service_pb2_grpc.TrtllmServiceStub(channel).Generate(
                trt_request(f"auth-t-{secrets.token_hex(4)}"), metadata=metadata, timeout=60
            )
        ),
        "SglangScheduler.Generate": lambda: list(
            sglang_scheduler_pb2_grpc.SglangSchedulerStub(channel).Generate(
                sgl_request(f"auth-s-{secrets.token_hex(4)}", 2), metadata=metadata, timeout=60
            )
        ),
    }
    result = {}
    for name, call in calls.items():
        try:
            call()
            result[name] = grpc.StatusCode.OK
        except grpc.RpcError as e:
            result[name] = e.code()
    return result


def test_the_service_token_gates_the_standard_protocols(
    tokened: ManagedProcess, token_file: Path
) -> None:
    with grpc.insecure_channel(tokened.address) as ch:
        assert set(every_service(ch).values()) == {grpc.StatusCode.UNAUTHENTICATED}
        wrong = ((SERVICE_TOKEN_KEY, secrets.token_hex(32)),)
        assert set(every_service(ch, wrong).values()) == {grpc.StatusCode.UNAUTHENTICATED}
        good = ((SERVICE_TOKEN_KEY, token_file.read_text().strip()),)
        assert set(every_service(ch, good).values()) == {grpc.StatusCode.OK}


def test_mutual_tls_admits_a_certificate_from_the_ca_without_a_token(
    mtls: ManagedProcess, pki: Pki
) -> None:
    creds = mtls_credentials(pki, pki.client_cert, pki.client_key)
    with grpc.secure_channel(f"localhost:{mtls.port}", creds) as ch:
        assert set(every_service(ch).values()) == {grpc.StatusCode.OK}


@pytest.mark.parametrize("who", ["no client certificate", "another CA's certificate"])
def test_mutual_tls_refuses_callers_without_a_certificate_from_the_ca(
    mtls: ManagedProcess, pki: Pki, who: str
) -> None:
    cert, key = (None, None) if who.startswith("no") else (pki.stranger_cert, pki.stranger_key)
    with grpc.secure_channel(f"localhost:{mtls.port}", mtls_credentials(pki, cert, key)) as ch:
        assert set(every_service(ch).values()) == {grpc.StatusCode.UNAVAILABLE}
    # the handshake itself fails: the server asks for a certificate and rejects these
    with pytest.raises((ssl.SSLError, ConnectionResetError, OSError)):
        raw_tls_exchange(pki, mtls.port, cert, key)


def raw_tls_exchange(pki: Pki, port: int, cert: Path | None, key: Path | None) -> None:
    """A TLS connection offering ``cert``; raises when the server refuses it (TLS 1.3
    clients learn of a refused certificate on their first read)."""
    ctx = ssl.create_default_context(cafile=pki.tls.ca_cert)
    if cert is not None and key is not None:
        ctx.load_cert_chain(cert, key)
    ctx.set_alpn_protocols(["h2"])
    with (
        socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
        ctx.wrap_socket(raw, server_hostname="localhost") as tls,
    ):
        tls.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        if not tls.recv(1):
            raise ConnectionResetError("closed by the server")


def test_plaintext_to_the_mutual_tls_port_gets_nothing(mtls: ManagedProcess) -> None:
    with grpc.insecure_channel(mtls.address) as ch:
        assert set(every_service(ch).values()) == {grpc.StatusCode.UNAVAILABLE}


def test_half_a_tls_configuration_is_refused_at_start(model_dir: Path, pki: Pki) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "engine_svc", "--port", "0", "--model-dir", str(model_dir),
         "--tls-client-ca-file", str(pki.tls.ca_cert)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert out.returncode != 0
    assert "tls_cert_file and tls_key_file go together" in out.stderr
