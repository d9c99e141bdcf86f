"""How llm-client reaches the stack: TLS (or loopback plaintext) and the keys it sends.

The server's certificate is checked against --ca-cert, $LLM_CA_CERT, make run's
local CA (.run/tls/ca.crt, for a loopback address) or the system's roots, in that
order; keys come from a flag, an environment variable or make run's .run/ files.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import grpc

from common.addresses import host_of, is_loopback
from common.config import ROOT

RUN_DIR = Path(os.environ.get("LLM_RUN_DIR", ROOT / ".run"))


def read_key(flag: str | None, env: str, file: str) -> str:
    """The key from ``flag``, else ``$env``, else make run's ``.run/<file>``."""
    if flag:
        return flag
    if os.environ.get(env):
        return os.environ[env]
    path = RUN_DIR / file
    if path.exists():
        return path.read_text().strip()
    raise SystemExit(
        f"error: no key: pass it as a flag, set ${env}, or run `make run` (it writes {path})"
    )


def ca_cert(args: argparse.Namespace, host: str) -> Path | None:
    """The CA to trust: the flag, $LLM_CA_CERT, make run's for loopback, else None
    (gRPC's own roots)."""
    given = args.ca_cert or os.environ.get("LLM_CA_CERT")
    if given:
        if not Path(given).is_file():
            raise SystemExit(f"error: no CA certificate at {given}")
        return Path(given)
    local = RUN_DIR / "tls" / "ca.crt"
    return local if is_loopback(host) and local.is_file() else None


def open_channel(args: argparse.Namespace) -> grpc.Channel:
    """TLS to ``--address`` (plaintext only with --plaintext, only to loopback)."""
    host = host_of(args.address)
    if args.plaintext:
        if not is_loopback(host):
            raise SystemExit(
                f"error: --plaintext only to a loopback address, not {host!r}: "
                "Envoy serves TLS (trust its CA with --ca-cert)"
            )
        return grpc.insecure_channel(args.address)
    ca = ca_cert(args, host)
    creds = grpc.ssl_channel_credentials(root_certificates=ca.read_bytes() if ca else None)
    options = []
    if args.tls_server_name:
        options.append(("grpc.ssl_target_name_override", args.tls_server_name))
    return grpc.secure_channel(args.address, creds, options)
