"""The shared secret of internal calls: engines and tokenizers answer only the gateway.

A service started with ``service_token_file`` (engine, tokenizer) refuses every
RPC that does not carry that token in ``x-service-token`` metadata with
UNAUTHENTICATED, before its handler runs (``common.interceptors``);
``grpc.health.v1`` stays open for probes. The gateway reads the same file and
sends the token on every call to an engine or tokenizer. ``make run``
generates the file; deployments mount it from a Secret. An empty
``service_token_file`` leaves a service open (tests and single-host
development), and the service logs that it is.
"""

from __future__ import annotations

import os
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
