"""The hostile-input table through a real Envoy, where a client comes from.

Each row is a bad (or absurd but legal) request over gRPC or HTTP with the status
it must get; after the whole table nothing is held anywhere (gateway in-flight
gauge, replica outstanding counts, the tenant's leases, both engines' queues).
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc
import pytest

from common.procs import ManagedProcess
from common.redis_server import RedisServer
from deploy.envoy import EnvoyProcess
from llm.v1 import gateway_pb2, gateway_pb2_grpc
from tests.integration.gateway.conftest import (
    EnginePair,
    HttpGateway,
    chat,
    start_http_gateway,
)
from tests.integration.gateway.hostile_helpers import assert_idle

pytestmark = pytest.mark.integration


@dataclass(slots=True)
class Edge:
    envoy: EnvoyProcess
    hg: HttpGateway
    tenant: str
    key: str


@pytest.fixture(scope="module")
def edge(
    engines: EnginePair,
    tokenizer_server: ManagedProcess,
    gw_redis: RedisServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Edge]:
    engines.ensure_running()
    logs = tmp_path_factory.mktemp("hostile-envoy")
    hg = start_http_gateway(
        "hostile-gw", engines.addresses, tokenizer_server.address, gw_redis.url, logs
    )
    envoy = None
    try:
        cfg = hg.envoy_config(logs, plaintext=True)  # loopback; TLS: test_tls_envoy.py
        envoy = EnvoyProcess(cfg, log_dir=logs)
        envoy.start(timeout=60)
        tenant, key = hg.gw.tenant()
        yield Edge(envoy, hg, tenant, key)
    finally:
        if envoy is not None:
            envoy.stop()
        hg.gw.stop()


def grpc_call(
    edge: Edge, req: gateway_pb2.GenerateRequest | bytes, key: str | None = "", timeout: float = 60
) -> grpc.StatusCode:
    md = () if key is None else (("authorization", f"Bearer {key or edge.key}"),)
    with grpc.insecure_channel(edge.envoy.listener_address()) as ch:
        if isinstance(req, bytes):
            call = ch.unary_stream("/llm.v1.Gateway/Generate", None, None)
        else:
            call = gateway_pb2_grpc.GatewayStub(ch).Generate  # type: ignore[assignment]
        try:
            list(call(req, metadata=md, timeout=timeout))
        except grpc.RpcError as e:
            return e.code()
    return grpc.StatusCode.OK


def bad_utf8() -> bytes:
    raw = gateway_pb2.GenerateRequest(prompt="ab").SerializeToString()
    return raw.replace(b"ab", b"\xff\xfe")


def temperature(t: float) -> gateway_pb2.GenerateRequest:
    req = chat("Hi", max_tokens=2)
    req.sampling.temperature = t
    return req


GRPC_TABLE: list[tuple[str, Callable[[Edge], grpc.StatusCode], grpc.StatusCode]] = [
    ("no key", lambda e: grpc_call(e, chat("Hi", 2), key=None), grpc.StatusCode.UNAUTHENTICATED),
    (
        "made-up key",
        lambda e: grpc_call(e, chat("Hi", 2), key="sk-llm-" + "x" * 40),
        grpc.StatusCode.UNAUTHENTICATED,
    ),
    (
        "invalid UTF-8 in prompt",
        lambda e: grpc_call(e, bad_utf8()),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    ("temperature 5", lambda e: grpc_call(e, temperature(5.0)), grpc.StatusCode.INVALID_ARGUMENT),
    (
        "unknown model",
        lambda e: grpc_call(e, gateway_pb2.GenerateRequest(model="nope", prompt="Hi")),
        grpc.StatusCode.NOT_FOUND,
    ),
    (
        "no input",
        lambda e: grpc_call(e, gateway_pb2.GenerateRequest()),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    (
        "a deadline of 30 years",
        lambda e: grpc_call(e, chat("Hi", 2), timeout=1e9),
        grpc.StatusCode.OK,
    ),
]


@pytest.mark.parametrize(
    ("name", "send", "expected"), GRPC_TABLE, ids=[row[0] for row in GRPC_TABLE]
)
def test_grpc_table_through_envoy(
    edge: Edge, name: str, send: Callable[[Edge], grpc.StatusCode], expected: grpc.StatusCode
) -> None:
    assert send(edge) == expected, name


def reflection_list(edge: Edge, key: str | None) -> list[bytes]:
    """``list_services`` over gRPC reflection through Envoy (raw protobuf bytes)."""
    md = () if key is None else (("authorization", f"Bearer {key}"),)
    with grpc.insecure_channel(edge.envoy.listener_address()) as ch:
        call = ch.stream_stream(
            "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", None, None
        )
        return list(call(iter([b"\x3a\x00"]), metadata=md, timeout=10))  # list_services


def test_reflection_on_the_public_listener_needs_a_key(edge: Edge) -> None:
    for key in (None, "sk-llm-" + "y" * 40):
        with pytest.raises(grpc.RpcError) as err:
            reflection_list(edge, key)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    (answer,) = reflection_list(edge, edge.key)  # grpcurl -H 'authorization: ...' works
    assert b"llm.v1.Gateway" in answer


def http_post(edge: Edge, body: bytes, headers: dict[str, str]) -> int:
    conn = http.client.HTTPConnection(
        edge.envoy.listener_address().split(":")[0],
        int(edge.envoy.listener_address().split(":")[1]),
        timeout=60,
    )
    try:
        conn.request(
            "POST",
            "/v1/chat/completions",
            body=body,
            headers={"content-type": "application/json", **headers},
        )
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()


def ok_body(**extra: object) -> bytes:
    return json.dumps(
        {"model": "", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **extra}
    ).encode()


HTTP_TABLE: list[tuple[str, bytes, dict[str, str], bool, int]] = [
    # name, body, headers, with the tenant's key, expected status
    ("no key, malformed body", b"{" * 5000, {}, False, 401),
    ("malformed JSON", b'{"messages": [', {}, True, 400),
    ("wrong type", json.dumps({"messages": "Hi"}).encode(), {}, True, 400),
    ("x-request-timeout nan", ok_body(), {"x-request-timeout": "nan"}, True, 400),
    ("x-request-timeout 0", ok_body(), {"x-request-timeout": "0"}, True, 400),
    ("x-request-timeout 1e12", ok_body(), {"x-request-timeout": "1e12"}, True, 200),
    ("temperature -1", ok_body(temperature=-1), {}, True, 400),
    ("a valid request", ok_body(), {}, True, 200),
]


@pytest.mark.parametrize(
    ("name", "body", "headers", "with_key", "expected"),
    HTTP_TABLE,
    ids=[row[0] for row in HTTP_TABLE],
)
def test_http_table_through_envoy(
    edge: Edge, name: str, body: bytes, headers: dict[str, str], with_key: bool, expected: int
) -> None:
    auth = {"authorization": f"Bearer {edge.key}"} if with_key else {}
    assert http_post(edge, body, {**headers, **auth}) == expected, name


def test_after_the_tables_nothing_is_held(edge: Edge, engines: EnginePair) -> None:
    assert_idle(edge.hg.gw, edge.tenant, engines)
    usage = edge.hg.gw.usage(edge.tenant)
    assert usage.requests_total >= 3  # the OK rows were admitted and metered
