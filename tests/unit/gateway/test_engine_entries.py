"""``[gateway] engines`` entries: a protocol per engine, options for standard engines,
and the engine TLS settings checked together."""

from __future__ import annotations

import pytest

from gateway.config import GatewayConfig, parse_engine_entry


@pytest.mark.parametrize(
    ("text", "protocol", "host", "port", "version"),
    [
        ("10.0.0.1:50071", "llm", "10.0.0.1", 50071, ""),
        ("llm://engine:50071", "llm", "engine", 50071, ""),
        ("vllm://vllm-pods:8000?model=smol&version=v2", "vllm", "vllm-pods", 8000, "v2"),
        ("trtllm://[::1]:8001", "trtllm", "::1", 8001, ""),
        ("sglang://sglang-pods:30000?version=v1", "sglang", "sglang-pods", 30000, "v1"),
    ],
)
def test_entries_parse_and_print_back(
    text: str, protocol: str, host: str, port: int, version: str
) -> None:
    entry = parse_engine_entry(text)
    assert (entry.protocol, entry.host, entry.port, entry.version) == (
        protocol,
        host,
        port,
        version,
    )
    assert str(entry) == text.removeprefix("llm://")
    assert entry.with_host("10.9.9.9").tls_name == host  # an address checks its name's cert


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("http://a:1", "names protocol 'http'"),
        ("vllm://a", "is not"),
        ("vllm://a:1?foo=1", "sets ['foo']"),
        ("vllm://a:1?model", "the query is not"),
        ("llm://a:1?version=v", "reports its own model and version"),
    ],
)
def test_bad_entries_are_refused_naming_the_entry(text: str, message: str) -> None:
    with pytest.raises(ValueError, match="engines") as err:
        GatewayConfig(engines=[text])
    assert message in str(err.value)


def test_engine_tls_settings_go_together() -> None:
    with pytest.raises(ValueError, match="go together"):
        GatewayConfig(engine_tls_ca_file="ca.pem", engine_tls_cert_file="c.pem")
    with pytest.raises(ValueError, match="needs engine_tls_ca_file"):
        GatewayConfig(engine_tls_cert_file="c.pem", engine_tls_key_file="k.pem")
    GatewayConfig(engine_tls_ca_file="ca.pem")  # TLS without a client certificate


@pytest.mark.parametrize("weight", [-0.1, 1.5])
def test_the_prefix_weight_is_a_share(weight: float) -> None:
    with pytest.raises(ValueError, match="prefix_weight must be between 0 and 1"):
        GatewayConfig(prefix_weight=weight)
    assert GatewayConfig(prefix_weight=0.0).prefix_weight == 0.0
