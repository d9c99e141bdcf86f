"""llm-client's transport: TLS by default, which CA it trusts, plaintext to loopback only.

The handshakes themselves run against a real Envoy in
tests/integration/gateway/test_tls_envoy.py.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import grpc
import pytest

from llm_client import cli, transport


def args(*argv: str) -> argparse.Namespace:
    return cli.parser().parse_args([*argv, "admin", "tenants"])


@pytest.fixture
def run_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(transport, "RUN_DIR", tmp_path)
    monkeypatch.delenv("LLM_CA_CERT", raising=False)
    return tmp_path


def test_the_ca_is_the_flag_then_the_environment_then_make_runs_for_loopback(
    run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    flag, env = tmp_path / "flag.pem", tmp_path / "env.pem"
    flag.write_text("x")
    env.write_text("x")
    local = run_dir / "tls" / "ca.crt"
    a = cli.parser().parse_args(["--ca-cert", str(flag), "admin", "tenants"])
    assert transport.ca_cert(a, "llm.example.com") == flag
    monkeypatch.setenv("LLM_CA_CERT", str(env))
    assert transport.ca_cert(args(), "llm.example.com") == env
    monkeypatch.delenv("LLM_CA_CERT")
    assert transport.ca_cert(args(), "127.0.0.1") is None  # make run has not written one
    local.parent.mkdir()
    local.write_text("x")
    assert transport.ca_cert(args(), "127.0.0.1") == local
    assert transport.ca_cert(args(), "localhost") == local
    # another host is not make run's: the system's roots
    assert transport.ca_cert(args(), "llm.example.com") is None


def test_a_missing_ca_file_is_an_error_not_a_fallback(run_dir: Path) -> None:
    a = cli.parser().parse_args(["--ca-cert", str(run_dir / "nope.pem"), "admin", "tenants"])
    with pytest.raises(SystemExit, match="no CA certificate"):
        transport.ca_cert(a, "127.0.0.1")


@pytest.mark.parametrize("address", ["10.0.0.5:8080", "llm.example.com:443", "0.0.0.0:8080"])
def test_plaintext_is_refused_off_loopback(run_dir: Path, address: str) -> None:
    with pytest.raises(SystemExit, match="--plaintext only to a loopback address"):
        transport.open_channel(args("--address", address, "--plaintext"))


@pytest.mark.parametrize("address", ["127.0.0.1:8080", "localhost:8080", "[::1]:8080"])
def test_plaintext_to_loopback_and_tls_elsewhere_open_channels(run_dir: Path, address: str) -> None:
    for argv in (["--plaintext"], [], ["--tls-server-name", "llm.example.com"]):
        channel = transport.open_channel(args("--address", address, *argv))
        assert isinstance(channel, grpc.Channel)
        channel.close()
