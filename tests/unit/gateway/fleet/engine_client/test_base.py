"""The seam's pieces: refusals in gRPC's shape, engine channel security from config
files, and the client each engine entry names."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from gateway.config import parse_engine_entry
from gateway.fleet.engine_client import connect
from gateway.fleet.engine_client.base import ChannelSecurity, refuse
from gateway.fleet.engine_client.llm_v1 import LlmV1Client
from gateway.fleet.engine_client.sglang import SglangClient
from gateway.fleet.engine_client.trtllm import TrtllmClient
from gateway.fleet.engine_client.vllm import VllmClient


def test_a_refusal_is_invalid_argument_naming_field_and_engine() -> None:
    err = refuse("sampling.seed", "vllm://10.0.0.1:8000", "too large")
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details() == "sampling.seed: too large; engine vllm://10.0.0.1:8000 cannot carry it"


def test_security_from_files(tmp_path: Path) -> None:
    assert ChannelSecurity.from_files("").root_certificates is None  # plaintext
    ca, cert, key = (tmp_path / n for n in ("ca.pem", "cert.pem", "key.pem"))
    ca.write_bytes(b"CA")
    cert.write_bytes(b"CERT")
    key.write_bytes(b"KEY")
    tls = ChannelSecurity.from_files(str(ca), str(cert), str(key), "engine.internal")
    assert tls.root_certificates == b"CA"
    assert tls.certificate_chain == b"CERT"
    assert tls.private_key == b"KEY"
    assert tls.server_name == "engine.internal"
    with pytest.raises(ValueError, match="engine_tls_key_file"):
        ChannelSecurity.from_files(str(ca), str(cert), str(tmp_path / "missing.pem"))


@pytest.mark.parametrize(
    ("entry", "kind", "protocol"),
    [
        ("127.0.0.1:50071", LlmV1Client, "llm"),
        ("llm://127.0.0.1:50071", LlmV1Client, "llm"),
        ("vllm://127.0.0.1:8000?model=m&version=v2", VllmClient, "vllm"),
        ("trtllm://[::1]:8001", TrtllmClient, "trtllm"),
        ("sglang://127.0.0.1:30000?model=m", SglangClient, "sglang"),
    ],
)
async def test_each_entry_gets_the_client_of_its_protocol(
    entry: str, kind: type, protocol: str
) -> None:
    client = connect(parse_engine_entry(entry), "t" * 32)
    try:
        assert isinstance(client, kind)
        assert client.protocol == protocol
        assert "://" not in client.address  # the channel's target is host:port
    finally:
        await client.close()
