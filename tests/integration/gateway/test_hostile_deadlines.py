"""Hostile callers against the real stack: request ids they do not own, absurd deadlines.

Every case ends by checking that nothing is held afterwards: the gateway's
in-flight gauge, every replica's outstanding count and the tenant's
concurrency leases (Redis) are back at zero, and the engines' KV pools idle.
"""

from __future__ import annotations

import http.client
import json
import math
import threading
import time

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llm.v1 import common_pb2, gateway_pb2
from tests.integration.gateway.conftest import (
    EnginePair,
    GatewayProcess,
    HttpGateway,
    chat,
)
from tests.integration.gateway.hostile_helpers import (
    LONG,
    assert_idle,
)

pytestmark = pytest.mark.integration


def test_a_reused_request_id_never_touches_another_stream(
    gateway: GatewayProcess, engines: EnginePair
) -> None:
    """Two tenants (and one of them twice) send the same live request id at once: each
    stream runs to its full length, and each sees the id it sent (a correlation id only)."""
    tid_a, key_a = gateway.tenant()
    tid_b, key_b = gateway.tenant()
    shared = "victim-request-1"
    req = gateway_pb2.GenerateRequest()
    req.CopyFrom(LONG)
    req.request_id = shared
    results: dict[str, list[gateway_pb2.GenerateResponse]] = {}
    errors: list[BaseException] = []
    first_is_live = threading.Event()
    ended: dict[str, float] = {}

    def run(name: str, key: str) -> None:
        chunks: list[gateway_pb2.GenerateResponse] = []
        try:
            for chunk in gateway.stub.Generate(
                req, metadata=(("authorization", f"Bearer {key}"),), timeout=120
            ):
                chunks.append(chunk)
                first_is_live.set()
            results[name] = chunks
        except BaseException as e:  # surfaced below
            errors.append(e)
        finally:
            first_is_live.set()
            ended[name] = time.monotonic()

    first = threading.Thread(target=run, args=("a1", key_a))
    first.start()
    assert first_is_live.wait(120)  # its first chunk arrived: the id is live on an engine
    started_others = time.monotonic()
    others = [threading.Thread(target=run, args=(n, k)) for n, k in (("b", key_b), ("a2", key_a))]
    for t in others:
        t.start()
    for t in (first, *others):
        t.join(180)
    assert not errors, errors
    assert ended["a1"] > started_others  # the three streams overlapped
    for name, chunks in results.items():
        assert sum(len(c.token_ids) for c in chunks) == 48, name
        assert chunks[-1].finish_reason == common_pb2.LENGTH, name
        assert {c.request_id for c in chunks} == {shared}, name
    for tid in (tid_a, tid_b):
        assert_idle(gateway, tid, engines)


# x-request-timeout values a hostile or careless client sends, and what they must get
TIMEOUTS = st.sampled_from(
    [
        "1e12",
        "1e308",
        "99999999",
        "0",
        "-1",
        "nan",
        "NaN",
        "inf",
        "-inf",
        "99999999H",
        "",
        "abc",
        "1e-9",
        "0.000001",
    ]
) | st.floats(allow_nan=True, allow_infinity=True).map(repr)


def expected_http_status(raw: str) -> set[int]:
    try:
        value = float(raw)
    except ValueError:
        return {400}
    if math.isnan(value) or value <= 0 or math.isinf(value):
        return {400}
    if value < 30:
        return {200, 504}  # may pass before the answer on a slow, shared machine
    return {200}


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(raw=TIMEOUTS)
def test_absurd_http_deadlines_get_a_clear_status_and_release_everything(
    http_gateway: HttpGateway, engines: EnginePair, raw: str
) -> None:
    gw = http_gateway.gw
    tid, key = gw.tenant()
    conn = http.client.HTTPConnection("127.0.0.1", http_gateway.http_port, timeout=120)
    try:
        body = json.dumps({"model": "", "prompt": "Hi", "max_tokens": 2})
        conn.request(
            "POST",
            "/v1/completions",
            body=body,
            headers={
                "Authorization": f"Bearer {key}",
                "Content-Type": "application/json",
                "x-request-timeout": raw,
            },
        )
        resp = conn.getresponse()
        payload = json.loads(resp.read() or b"{}")
    finally:
        conn.close()
    assert resp.status in expected_http_status(raw), (raw, resp.status, payload)
    if resp.status == 400:
        assert "x-request-timeout" in payload["error"]["message"]
    assert_idle(gw, tid, engines)


@pytest.mark.parametrize("timeout_s", [1e9, 1e7, 3600.5, 86400.0 * 365])
def test_huge_grpc_deadlines_are_cut_to_the_maximum_and_release_everything(
    gateway: GatewayProcess, engines: EnginePair, timeout_s: float
) -> None:
    tid, key = gateway.tenant()
    chunks = gateway.generate(key, chat("Hi", max_tokens=2), timeout=timeout_s)
    assert chunks[-1].finish_reason in (common_pb2.STOP, common_pb2.LENGTH)
    assert_idle(gateway, tid, engines)


def test_a_deadline_that_passes_mid_stream_releases_everything(
    gateway: GatewayProcess, engines: EnginePair
) -> None:
    """The deadline is a quarter of what the whole stream takes on this machine (measured
    first), so it passes mid-stream however fast or slow the machine is."""
    tid, key = gateway.tenant()
    start = time.monotonic()
    assert gateway.generate(key, LONG, timeout=120)[-1].finish_reason == common_pb2.LENGTH
    whole = time.monotonic() - start
    with pytest.raises(grpc.RpcError) as err:
        gateway.generate(key, LONG, timeout=whole / 4)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert_idle(gateway, tid, engines)
