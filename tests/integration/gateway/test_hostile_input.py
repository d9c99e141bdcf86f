"""Hostile callers against the real stack: ids they do not own, absurd deadlines.

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
from collections.abc import Callable

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llm.v1 import common_pb2, engine_pb2, engine_pb2_grpc, gateway_pb2
from tests.integration.gateway.conftest import (
    EnginePair,
    GatewayProcess,
    HttpGateway,
    chat,
    trailers,
)

pytestmark = pytest.mark.integration

LONG = chat("Count from one to one hundred, one number per line.", max_tokens=48, ignore_eos=True)


def wait_until(cond: Callable[[], bool], timeout: float = 20.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def assert_idle(gw: GatewayProcess, tenant_id: str, engines: EnginePair) -> None:
    """Nothing a finished request took is still held, anywhere."""
    assert wait_until(lambda: gw.metric("gateway_in_flight") == 0), "requests still in flight"
    assert wait_until(lambda: gw.metric("gateway_replica_outstanding") == 0), (
        "a replica slot was never released"
    )
    assert wait_until(lambda: gw.usage(tenant_id).concurrent_in_use == 0), "a lease leaked"
    for address in engines.addresses:
        with grpc.insecure_channel(address) as ch:
            stub = engine_pb2_grpc.EngineStub(ch)

            def engine_idle(stub: engine_pb2_grpc.EngineStub = stub) -> bool:
                stats = stub.GetStats(engine_pb2.GetStatsRequest())
                return stats.num_running == 0 and stats.num_waiting == 0

            assert wait_until(engine_idle), f"engine {address} still holds requests"


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


def stage_count(gateway: GatewayProcess, name: str) -> float:
    """How many times the gateway recorded admission stage ``name``."""
    return gateway.metric("gateway_stage_seconds_count", stage=name)


def gateway_encodes(gateway: GatewayProcess) -> float:
    """Prompts the gateway tokenized (in process or through tokenizer_svc)."""
    return stage_count(gateway, "encode")


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


def test_a_tenant_with_headroom_is_admitted_in_one_redis_call_and_charged_exactly(
    gateway: GatewayProcess, engines: EnginePair
) -> None:
    """Unknown here, a tenant's first request takes the request unit before the
    tokenizer (two calls); with headroom seen, later ones take unit, lease and tokens
    in one call after it. Either way the usage settles to exactly what was used."""
    tid, key = gateway.tenant(requests_per_minute=600, request_burst=50, tokens_per_minute=100_000)
    one, two = (
        gateway.metric("gateway_ratelimit_admissions_total", path=p) for p in ("one", "two")
    )
    used = 0
    for _ in range(4):
        chunks = gateway.generate(key, chat("Hi", 2))
        used += chunks[-1].usage.prompt_tokens + chunks[-1].usage.completion_tokens
    assert gateway.metric("gateway_ratelimit_admissions_total", path="two") == two + 1
    assert gateway.metric("gateway_ratelimit_admissions_total", path="one") == one + 3
    usage = gateway.usage(tid)
    assert usage.requests_total == 4
    assert usage.prompt_tokens_total + usage.completion_tokens_total == used
    assert_idle(gateway, tid, engines)


def test_an_overlapped_admission_that_redis_refuses_sends_nothing_and_charges_nothing(
    gateway: GatewayProcess, http_gateway: HttpGateway, engines: EnginePair
) -> None:
    """With headroom seen, a tenant's engine call starts while its one Redis call is in
    flight. When another gateway replica spent the tokens meanwhile, Redis refuses:
    the caller gets RESOURCE_EXHAUSTED and not one chunk, the engine call is
    cancelled, and the tenant is charged nothing for it."""
    other = http_gateway.gw  # a second replica on the same Redis
    tid, key = gateway.tenant(
        requests_per_minute=600, request_burst=50, tokens_per_minute=60, token_burst=2000
    )
    overlapped = gateway.metric("gateway_ratelimit_overlapped_admissions_total")
    refused = gateway.metric("gateway_ratelimit_overlap_refusals_total")
    reserve, overlap = stage_count(gateway, "reserve"), stage_count(gateway, "reserve_overlap")
    assert gateway.generate(key, chat("Hi", 1))  # two calls: this replica sees the levels
    assert stage_count(gateway, "reserve") == reserve + 1  # before the tokenizer
    assert gateway.generate(key, chat("Hi", 1))  # one call, overlapping the engine's start
    assert gateway.metric("gateway_ratelimit_overlapped_admissions_total") == overlapped + 1
    # its time is recorded apart: it is not a stage on the request's path
    assert stage_count(gateway, "reserve") == reserve + 1
    assert stage_count(gateway, "reserve_overlap") == overlap + 1
    left = gateway.usage(tid).tokens_available
    assert other.generate(key, chat("hello " * int(left - 120), 1))  # spends all but ~100
    before = gateway.usage(tid)
    md = (("authorization", f"Bearer {key}"),)
    got: list[gateway_pb2.GenerateResponse] = []
    stream = gateway.stub.Generate(chat("hello " * 200, 8), metadata=md, timeout=60)
    with pytest.raises(grpc.RpcError) as err:  # this replica's memo still sees ~1900
        got.extend(stream)
    assert got == []
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "token" in (err.value.details() or "")
    assert gateway.metric("gateway_ratelimit_overlapped_admissions_total") == overlapped + 2
    assert gateway.metric("gateway_ratelimit_overlap_refusals_total") == refused + 1
    after = gateway.usage(tid)
    assert after.prompt_tokens_total == before.prompt_tokens_total  # nothing charged
    assert after.completion_tokens_total == before.completion_tokens_total
    assert after.requests_denied_total == before.requests_denied_total + 1
    assert_idle(gateway, tid, engines)
    assert gateway.generate(key, chat("Hi", 1))  # after a refusal: the two-call path again
    assert gateway.metric("gateway_ratelimit_overlapped_admissions_total") == overlapped + 2


def test_a_client_gone_during_an_overlapped_admission_leaves_nothing_held(
    gateway: GatewayProcess, engines: EnginePair
) -> None:
    """A client that leaves while the engine runs the prefill of an overlapped
    admission (no chunk sent yet): the reservation that came back meanwhile is
    settled, its lease freed and its unused tokens returned, the engine aborts."""
    tid, key = gateway.tenant(  # tokens refill at 1 a second: the test sees no refill
        requests_per_minute=600,
        request_burst=50,
        tokens_per_minute=60,
        token_burst=100_000,
        max_concurrent=8,
    )
    assert gateway.generate(key, chat("Hi", 1))  # two calls: this replica sees the levels
    overlapped = gateway.metric("gateway_ratelimit_overlapped_admissions_total")
    md = (("authorization", f"Bearer {key}"),)
    call = gateway.stub.Generate(chat("hello " * 1500, 64), metadata=md, timeout=60)
    assert wait_until(
        lambda: gateway.metric("gateway_ratelimit_overlapped_admissions_total") == overlapped + 1,
        timeout=10,
    )
    call.cancel()  # type: ignore[no-untyped-call]  # a 1,500-token prefill still runs
    assert_idle(gateway, tid, engines)
    usage = gateway.usage(tid)
    charged = usage.prompt_tokens_total + usage.completion_tokens_total
    # what it reserved and did not use (up to 64 output tokens) came back; refill adds ~1/s
    assert usage.tokens_available == pytest.approx(100_000 - charged, abs=20)
    assert gateway.generate(key, chat("Hi", 1))


def test_refused_prompts_spend_request_units_on_the_one_call_path_too(
    gateway: GatewayProcess, engines: EnginePair
) -> None:
    """A prompt refused after tokenizing (here: no room for max_tokens) spends its
    request unit on either path, so bad prompts cannot be tokenized past the rate."""
    tid, key = gateway.tenant(requests_per_minute=1, request_burst=5)
    assert gateway.generate(key, chat("Hi", 1))  # two calls; 4 units left
    for _ in range(3):  # the first ones with headroom: one call, after the tokenizer
        with pytest.raises(grpc.RpcError) as err:
            gateway.generate(key, chat("Hi", 2040))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert gateway.generate(key, chat("Hi", 1))  # the fifth unit
    with pytest.raises(grpc.RpcError) as err:
        gateway.generate(key, chat("Hi", 1))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert_idle(gateway, tid, engines)
