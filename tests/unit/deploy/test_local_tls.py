"""deploy/envoy/tls.py: make run's local CA and server certificate, made once, reused."""

from __future__ import annotations

import ssl
from pathlib import Path

import pytest

from deploy.envoy.tls import (
    CA_DAYS,
    SERVER_DAYS,
    TlsFiles,
    ca_problem,
    ensure_local_tls,
    server_problem,
)
from tests.unit.deploy.helpers import OPENSSL_WHY, require_tool


@pytest.fixture(autouse=True)
def _openssl() -> None:
    require_tool("openssl", OPENSSL_WHY)


def handshake(files: TlsFiles, server_name: str, ca: Path | None = None) -> str:
    """A TLS handshake in memory: Envoy's side with the server certificate, a client
    that trusts ``ca`` (default: the local CA) and checks ``server_name``; the
    negotiated version."""
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(files.cert, files.key)
    client_ctx = ssl.create_default_context(cafile=ca or files.ca_cert)
    client_ctx.verify_flags |= ssl.VERIFY_X509_STRICT  # as Python 3.13 does by default
    c_in, c_out, s_in, s_out = (ssl.MemoryBIO() for _ in range(4))
    client = client_ctx.wrap_bio(c_in, c_out, server_hostname=server_name)
    server = server_ctx.wrap_bio(s_in, s_out, server_side=True)
    done = {"client": False, "server": False}
    for _ in range(10):
        for name, end, out, peer_in in (
            ("client", client, c_out, s_in),
            ("server", server, s_out, c_in),
        ):
            if not done[name]:
                try:
                    end.do_handshake()
                    done[name] = True
                except ssl.SSLWantReadError:
                    pass
            peer_in.write(out.read())
        if all(done.values()):
            return str(client.version())
    raise AssertionError("handshake did not finish")


def mtimes(files: TlsFiles) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in (files.ca_cert, files.ca_key, files.cert)}


def test_made_once_private_and_trusted_for_localhost(tmp_path: Path) -> None:
    files = ensure_local_tls(tmp_path / "tls")
    assert sorted(p.name for p in files.dir.iterdir()) == ["ca.crt", "ca.key", "tls.crt", "tls.key"]
    assert files.dir.stat().st_mode & 0o777 == 0o700
    for key in (files.key, files.ca_key):
        assert key.stat().st_mode & 0o077 == 0
    assert ca_problem(files) is None
    assert server_problem(files) is None
    for name in ("localhost", "127.0.0.1", "::1"):
        assert handshake(files, name) in ("TLSv1.2", "TLSv1.3")
    with pytest.raises(ssl.SSLCertVerificationError, match="mismatch"):
        handshake(files, "example.com")
    before = mtimes(files)
    ensure_local_tls(files.dir)
    assert mtimes(files) == before  # valid: reused as it is


def test_a_client_that_trusts_another_ca_refuses_it(tmp_path: Path) -> None:
    files = ensure_local_tls(tmp_path / "a")
    other = ensure_local_tls(tmp_path / "b")
    with pytest.raises(ssl.SSLCertVerificationError, match="unable to get local issuer"):
        handshake(files, "localhost", ca=other.ca_cert)


def test_a_server_certificate_that_fails_a_check_is_issued_again_by_the_same_ca(
    tmp_path: Path,
) -> None:
    files = ensure_local_tls(tmp_path)
    ca = files.ca_cert.read_bytes()
    # names a host it does not cover
    assert server_problem(files, dns=["llm.example.com"]) is not None
    ensure_local_tls(files.dir, dns=["localhost", "llm.example.com"])
    assert files.ca_cert.read_bytes() == ca
    assert handshake(files, "llm.example.com")
    # expires too soon
    cert = files.cert.read_bytes()
    assert "expires" in (server_problem(files, min_days=SERVER_DAYS + 1) or "")
    ensure_local_tls(files.dir, min_days=SERVER_DAYS + 1)
    assert files.cert.read_bytes() != cert
    assert files.ca_cert.read_bytes() == ca
    # a key that is not its own, a certificate of another CA
    other = ensure_local_tls(tmp_path / "other")
    files.key.write_bytes(other.key.read_bytes())
    assert "key does not match" in (server_problem(files) or "")
    files.cert.write_bytes(other.cert.read_bytes())
    assert "not signed by the CA" in (server_problem(files) or "")
    ensure_local_tls(files.dir)
    assert server_problem(files) is None
    assert files.ca_cert.read_bytes() == ca
    assert handshake(files, "localhost")


def test_a_ca_that_fails_a_check_is_made_again_with_its_server_certificate(
    tmp_path: Path,
) -> None:
    files = ensure_local_tls(tmp_path)
    ca, cert = files.ca_cert.read_bytes(), files.cert.read_bytes()
    assert "expires" in (ca_problem(files, min_days=CA_DAYS + 1) or "")
    files.ca_key.write_text("not a key\n")
    assert "does not match" in (ca_problem(files) or "")
    ensure_local_tls(files.dir)
    assert files.ca_cert.read_bytes() != ca
    assert files.cert.read_bytes() != cert
    assert ca_problem(files) is None
    assert server_problem(files) is None
    assert handshake(files, "127.0.0.1")
