"""The shared secret of internal calls: engines and tokenizers answer only the gateway.

A service started with ``service_token_file`` (engine, tokenizer) refuses every
RPC that does not carry that token in ``x-service-token`` metadata with
UNAUTHENTICATED, before its handler runs (``common.interceptors``);
``grpc.health.v1`` stays open for probes. The gateway reads the same file and
sends the token on every call to an engine or tokenizer. ``make run``
generates the file; deployments mount it from a Secret. An empty
``service_token_file`` leaves a service open (tests and single-host
development), and the service logs that it is.

Mutual TLS is the other way in, for callers that cannot send metadata: a service
given a server certificate, its key and a client CA (``read_server_tls``) serves
TLS only and requires a client certificate signed by that CA in the handshake;
that certificate then stands for the token.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from common.config import ROOT

SERVICE_TOKEN_KEY = "x-service-token"
MIN_TOKEN_CHARS = 32


def read_service_token(path: str) -> str:
    """The token in ``path`` ("" for an empty path: no service auth).

    Raises:
        ValueError: the file is missing, or holds fewer than 32 characters.
    """
    return read_secret_file(path, "service_token_file")


def read_secret_file(path: str, setting: str) -> str:
    """The secret in ``path`` (surrounding whitespace stripped; "" for an empty path).

    Args:
        path: the file (a mounted Secret, ``make run``'s ``.run/`` file).
        setting: the config key that named it, for the error message.

    Raises:
        ValueError: the file is missing, or holds fewer than 32 characters.
    """
    if not path:
        return ""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"{setting} {path!r} does not exist")
    secret = file.read_text().strip()
    check_secret(secret, f"{setting} {path!r}")
    return secret


def check_secret(secret: str, what: str) -> None:
    """The rule every internal secret follows (service token, Redis password).

    Raises:
        ValueError: ``secret`` has fewer than 32 characters or holds whitespace.
    """
    if len(secret) < MIN_TOKEN_CHARS or any(c.isspace() for c in secret):
        raise ValueError(
            f"{what} must hold a secret of at least {MIN_TOKEN_CHARS} "
            "characters without whitespace (e.g. `openssl rand -hex 32`)"
        )


def default_token_file() -> str:
    """``make run``'s token (``$LLM_RUN_DIR`` or ``.run/``, ``service.token``) when it
    exists, else "": what command-line clients use unless told otherwise."""
    path = Path(os.environ.get("LLM_RUN_DIR") or ROOT / ".run") / "service.token"
    return str(path) if path.is_file() else ""


def token_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """Metadata to add to a call to an internal service (empty without a token)."""
    return ((SERVICE_TOKEN_KEY, token),) if token else ()


@dataclass(frozen=True, slots=True)
class ServerTls:
    """A gRPC port's TLS material (PEM bytes).

    With ``client_ca`` the port is mutual TLS: the handshake requires a client
    certificate signed by that CA, and that certificate is the caller's credential
    (for clients such as SMG that authenticate to workers with certificates and cannot
    send the service token).
    """

    cert_chain: bytes
    private_key: bytes
    client_ca: bytes = b""

    @property
    def mutual(self) -> bool:
        """True when callers must present a certificate signed by ``client_ca``."""
        return bool(self.client_ca)


def read_server_tls(cert_file: str, key_file: str, client_ca_file: str) -> ServerTls | None:
    """The TLS material the three settings name; None when none is set (plaintext).

    Raises:
        ValueError: only one of certificate and key is set, a client CA is set without
            them, or a file is missing or holds no PEM block.
    """
    if not (cert_file or key_file or client_ca_file):
        return None
    if not (cert_file and key_file):
        raise ValueError(
            "tls_cert_file and tls_key_file go together (a client CA needs them too): "
            f"got tls_cert_file={cert_file!r}, tls_key_file={key_file!r}"
        )

    def pem(path: str, setting: str) -> bytes:
        file = Path(path)
        if not file.is_file():
            raise ValueError(f"{setting} {path!r} does not exist")
        data = file.read_bytes()
        if b"-----BEGIN " not in data:
            raise ValueError(f"{setting} {path!r} holds no PEM block")
        return data

    return ServerTls(
        pem(cert_file, "tls_cert_file"),
        pem(key_file, "tls_key_file"),
        pem(client_ca_file, "tls_client_ca_file") if client_ca_file else b"",
    )
