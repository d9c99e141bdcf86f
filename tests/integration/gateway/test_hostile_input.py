"""Hostile input against the real stack: bodies, fields and messages built to break
the parser or the bill, and keys sprayed from one address.

Every case that reaches the gateway checks that nothing is held afterwards
(``hostile_helpers.assert_idle``).
"""

from __future__ import annotations

import http.client
import json

import grpc
import pytest

from llm.v1 import engine_pb2, gateway_pb2
from tests.integration.gateway.conftest import (
    EnginePair,
    GatewayProcess,
    HttpGateway,
    chat,
    trailers,
)
from tests.integration.gateway.hostile_helpers import (
    assert_idle,
    gateway_encodes,
)

pytestmark = pytest.mark.integration


def post(hg: HttpGateway, body: bytes, headers: dict[str, str]) -> tuple[int, dict[str, object]]:
    conn = http.client.HTTPConnection("127.0.0.1", hg.http_port, timeout=60)
    try:
        conn.request(
            "POST",
            "/v1/chat/completions",
            body=body,
            headers={"Content-Type": "application/json", **headers},
        )
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"{}")
    finally:
        conn.close()


@pytest.mark.parametrize("authorization", ["", "Bearer sk-not-a-real-key", "Basic abc"])
def test_the_key_is_checked_before_the_body_is_read(
    http_gateway: HttpGateway, authorization: str
) -> None:
    """A malformed body from a caller without a valid key is a 401, not a 400: nothing
    of the body was parsed (or logged) before authentication."""
    marker = "unauthenticated-user-marker"
    body = b'{"messages": [' + b"[" * 5000 + b'], "user": "' + marker.encode() + b'"'
    status, payload = post(
        http_gateway, body, {"Authorization": authorization} if authorization else {}
    )
    assert status == 401, payload
    assert marker not in http_gateway.gw.proc.log_path.read_text()


HI = b'{"role": "user", "content": "Hi"}'


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        (
            b'{"messages": [{"role": "user", "content": "a\\ud800b"}], "max_tokens": 1}',
            "messages[0].content",
            "lone UTF-16 surrogate",
        ),
        (
            b'{"messages": [' + HI + b'], "stop": ["\\udfff"], "max_tokens": 1}',
            "stop[0]",
            "not valid Unicode",
        ),
        (
            b'{"messages": [' + HI + b'], "user": "\\ud83d", "max_tokens": 1}',
            "user",
            "not valid Unicode",
        ),
        (
            b'{"messages": [' + HI + b'], "metadata": ' + b"[" * 100 + b"]" * 100 + b"}",
            "metadata",
            "nests deeper than 32 levels",
        ),
        (
            b'{"messages": [' + HI + b'], "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
            None,
            "nests too deeply",
        ),
        (b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', None, "not valid UTF-8"),
        (b'{"messages": [' + HI + b'], "max_tokens": "8"}', "max_tokens", "must be an integer"),
    ],
)
def test_malformed_bodies_get_400_naming_the_field(
    http_gateway: HttpGateway, body: bytes, param: str | None, message: str
) -> None:
    """Never a 500: JSON that Python decodes but UTF-8 cannot carry, bodies nested past
    any real request (or past the decoder's own limit), bytes that are not UTF-8."""
    _, key = http_gateway.gw.tenant()
    status, payload = post(http_gateway, body, {"Authorization": f"Bearer {key}"})
    assert status == 400, payload
    error = payload["error"]
    assert isinstance(error, dict)
    assert message in str(error["message"])
    if param is not None:
        assert str(error["param"]).startswith(param), error


@pytest.mark.parametrize("charset", ["x-bogus", "rot13"])
def test_an_unknown_or_binary_charset_is_400_naming_it(
    http_gateway: HttpGateway, charset: str
) -> None:
    """A charset Python cannot decode text with (unknown, or a bytes-to-bytes codec such as
    rot13) is the client's error, never a 500 (which Envoy would count toward ejection)."""
    _, key = http_gateway.gw.tenant()
    body = b'{"messages": [' + HI + b"]}"
    headers = {
        "Authorization": f"Bearer {key}",
        "Content-Type": f"application/json; charset={charset}",
    }
    status, payload = post(http_gateway, body, headers)
    assert status == 400, payload
    error = payload["error"]
    assert isinstance(error, dict)
    assert charset in str(error["message"])
    assert "UTF-8" in str(error["message"])


def test_logged_client_fields_are_truncated(http_gateway: HttpGateway) -> None:
    _, key = http_gateway.gw.tenant()
    user = "u" * 5000
    body = json.dumps(
        {
            "model": "",
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 1,
            "user": user,
        }
    ).encode()
    status, _ = post(http_gateway, body, {"Authorization": f"Bearer {key}"})
    assert status == 200
    log = http_gateway.gw.proc.log_path.read_text()
    assert "u" * 64 in log
    assert "u" * 65 not in log


def test_an_oversized_grpc_message_is_refused_before_any_work(
    gateway: GatewayProcess, engines: EnginePair
) -> None:
    """Over the gateway's max_message_bytes (4 MiB): RESOURCE_EXHAUSTED from gRPC itself,
    before authentication, tokenization or metering run."""
    tid, key = gateway.tenant()
    before = gateway.metric("gateway_requests_total")
    huge = gateway_pb2.GenerateRequest(prompt="x" * (5 * 1024 * 1024))
    with pytest.raises(grpc.RpcError) as err:
        gateway.generate(key, huge, timeout=60)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert gateway.metric("gateway_requests_total") == before  # the pipeline never ran
    assert_idle(gateway, tid, engines)


def test_a_prompt_longer_than_any_context_could_hold_is_refused_before_tokenizing(
    gateway: GatewayProcess, engines: EnginePair
) -> None:
    """2,048-token context here: 300,000 characters cannot fit (at most 128 a token), so
    the gateway refuses it without tokenizing it or reserving anything."""
    tid, key = gateway.tenant()
    encodes_before = gateway_encodes(gateway)
    with pytest.raises(grpc.RpcError) as err:
        gateway.generate(key, gateway_pb2.GenerateRequest(prompt="word " * 60_000), timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "300000 characters" in (err.value.details() or "")
    assert gateway_encodes(gateway) == encodes_before
    assert gateway.usage(tid).requests_total == 0  # nothing was reserved
    assert_idle(gateway, tid, engines)


def test_an_over_rate_tenant_costs_no_tokenizing(
    gateway: GatewayProcess, engines: EnginePair
) -> None:
    """The request unit is taken before the prompt is tokenized: a flood over the request
    rate is refused without one encode, by Redis first and then by the gateway's memo."""
    tid, key = gateway.tenant(requests_per_minute=1, request_burst=1)
    assert gateway.generate(key, chat("Hi", 1))
    encodes_before = gateway_encodes(gateway)
    for _ in range(5):
        with pytest.raises(grpc.RpcError) as err:
            gateway.generate(key, chat("A prompt that is never tokenized. " * 50, 1))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert gateway_encodes(gateway) == encodes_before
    assert gateway.metric("gateway_ratelimit_local_denials_total", tenant=tid) == 4
    assert_idle(gateway, tid, engines)


@pytest.mark.parametrize("service", ["gateway", "engine"])
def test_invalid_utf8_in_a_string_field_is_invalid_argument(
    gateway: GatewayProcess, engines: EnginePair, service: str
) -> None:
    """grpc's own answer would be INTERNAL ("Exception deserializing request!")."""
    if service == "gateway":
        address, method = gateway.proc.address, "/llm.v1.Gateway/Generate"
        raw = gateway_pb2.GenerateRequest(prompt="ab").SerializeToString()
    else:
        address, method = engines.addresses[0], "/llm.v1.Engine/Generate"
        raw = engine_pb2.EngineGenerateRequest(
            request_id="ab", prompt_token_ids=[1]
        ).SerializeToString()
    bad = raw.replace(b"ab", b"\xff\xfe")
    assert bad != raw
    with grpc.insecure_channel(address) as ch:
        call = ch.unary_stream(method, None, None)  # bytes in, bytes out
        with pytest.raises(grpc.RpcError) as err:
            list(call(bad, timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "UTF-8" in (err.value.details() or "")


def test_a_spray_of_bad_keys_from_one_address_is_throttled(gateway: GatewayProcess) -> None:
    """Past the burst of failed authentications (60 in the test config) an address gets
    RESOURCE_EXHAUSTED with a wait, without a key lookup; a key already known valid
    still works from there, and other addresses are not affected."""
    _, key = gateway.tenant()
    assert gateway.generate(key, chat("Hi", 2))  # now a known-valid key in the gateway's cache
    spray = (("x-forwarded-for", "198.51.100.23"),)  # the address Envoy would append
    before = gateway.metric("gateway_auth_throttled_total")
    codes = []
    for i in range(61):
        with pytest.raises(grpc.RpcError) as err:
            gateway.generate(
                f"sk-llm-made-up-key-{i:04d}-" + "x" * 24, chat("Hi", 2), metadata=spray
            )
        codes.append(err.value.code())
    assert set(codes[:60]) == {grpc.StatusCode.UNAUTHENTICATED}
    assert codes[60] == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "too many failed authentications from 198.51.100.23" in (err.value.details() or "")
    md = trailers(err.value)
    assert 0 < int(md["retry-after-ms"]) <= 2000  # one failure back every 2 s (30/min)
    assert gateway.metric("gateway_auth_throttled_total") == before + 1
    assert gateway.generate(key, chat("Hi", 2), metadata=spray)  # a known-good key still passes
    other = (("x-forwarded-for", "198.51.100.24"),)
    with pytest.raises(grpc.RpcError) as err:
        gateway.generate("sk-llm-another-made-up-key-" + "y" * 24, chat("Hi", 2), metadata=other)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
