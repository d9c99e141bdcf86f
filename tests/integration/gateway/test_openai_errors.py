"""Every error status of the HTTP front, as the official ``openai`` client classifies it.

401 bad key, 403 revoked key, 400 with ``param``, 404 unknown model, 429 with
Retry-After (and the SDK retrying it), 503 without engines, 504 past the
deadline, and a client that disconnects mid-stream freeing the engine.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from common.procs import ManagedProcess
from common.redis_server import RedisServer
from llm.v1 import admin_pb2, engine_pb2, engine_pb2_grpc
from tests.integration.gateway.conftest import (
    EnginePair,
    HttpGateway,
    free_port,
    start_http_gateway,
)

pytestmark = pytest.mark.integration

HI: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Hi"}]


_CLIENTS: list[openai.OpenAI] = []


def sdk(gw: HttpGateway, key: str, max_retries: int = 0) -> openai.OpenAI:
    client = openai.OpenAI(base_url=gw.base_url, api_key=key, max_retries=max_retries, timeout=60)
    _CLIENTS.append(client)
    return client


@pytest.fixture(autouse=True)
def _close_clients() -> Iterator[None]:
    yield
    while _CLIENTS:
        _CLIENTS.pop().close()


def wait_for(fn: object, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not fn():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def key(http_gateway: HttpGateway) -> str:
    return http_gateway.gw.tenant()[1]


def test_unknown_key_is_401(http_gateway: HttpGateway) -> None:
    with pytest.raises(openai.AuthenticationError) as info:
        sdk(http_gateway, "sk-llm-not-a-key").chat.completions.create(model="", messages=HI)
    assert info.value.status_code == 401
    assert info.value.code == "invalid_api_key"
    # the key is checked before the body: a bad key never learns about its params
    with pytest.raises(openai.AuthenticationError):
        sdk(http_gateway, "sk-llm-not-a-key").chat.completions.create(model="", messages=HI, n=3)


def test_revoked_key_is_403(http_gateway: HttpGateway) -> None:
    gw = http_gateway.gw
    tid, _ = gw.tenant()
    created = gw.admin.CreateApiKey(
        admin_pb2.CreateApiKeyRequest(tenant_id=tid, name="rv"), metadata=gw.admin_md
    )
    gw.admin.RevokeApiKey(
        admin_pb2.RevokeApiKeyRequest(key_id=created.api_key.key_id), metadata=gw.admin_md
    )
    with pytest.raises(openai.PermissionDeniedError) as info:
        sdk(http_gateway, created.key).chat.completions.create(model="", messages=HI)
    assert info.value.status_code == 403


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"n": 9}, "n"),  # over [gateway] max_n
        ({"temperature": 5.0}, "temperature"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"max_tokens": 100_000}, "max_tokens"),
        ({"stop": ["x"] * 40}, "stop"),
        ({"extra_body": {"messages": []}}, "messages"),
    ],
)
def test_invalid_params_are_400_with_param(
    http_gateway: HttpGateway, key: str, kwargs: dict[str, object], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        sdk(http_gateway, key).chat.completions.create(
            model="", messages=HI, **{"max_tokens": 2, **kwargs}
        )  # type: ignore[call-overload]
    assert info.value.status_code == 400
    assert info.value.param == param, info.value.message
    assert info.value.type == "invalid_request_error"


def test_unknown_model_is_404(http_gateway: HttpGateway, key: str) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        sdk(http_gateway, key).chat.completions.create(model="gpt-nope", messages=HI)
    assert info.value.code == "model_not_found"
    assert "gpt-nope" in info.value.message
    with pytest.raises(openai.NotFoundError):
        sdk(http_gateway, key).models.retrieve("gpt-nope")


def test_tenant_limit_is_429_with_retry_after(http_gateway: HttpGateway) -> None:
    _, key = http_gateway.gw.tenant(requests_per_minute=60, request_burst=1)
    client = sdk(http_gateway, key)
    client.completions.create(model="", prompt="Hi", max_tokens=1)
    with pytest.raises(openai.RateLimitError) as info:
        client.completions.create(model="", prompt="Hi", max_tokens=1)
    headers = info.value.response.headers
    assert 0 < int(headers["retry-after-ms"]) <= 1000
    assert headers["retry-after"] == "1"  # whole seconds, rounded up
    assert info.value.code == "rate_limit_exceeded"
    assert "requests_per_minute" in info.value.message


def test_sdk_retries_429_after_retry_after(http_gateway: HttpGateway) -> None:
    gw = http_gateway.gw
    tid, key = gw.tenant(requests_per_minute=60, request_burst=1)
    client = sdk(http_gateway, key, max_retries=3)
    client.completions.create(model="", prompt="Hi", max_tokens=1)
    start = time.monotonic()
    resp = client.completions.create(model="", prompt="Hi", max_tokens=1)  # 429, wait, 200
    assert resp.choices[0].finish_reason in ("stop", "length")
    assert time.monotonic() - start >= 0.5  # it waited for the bucket (about 1 s)
    assert gw.metric("gateway_ratelimit_denials_total", tenant=tid, dimension="requests") >= 1
    assert gw.metric("gateway_requests_total", tenant=tid, code="OK") == 2


def test_deadline_is_504(http_gateway: HttpGateway, key: str) -> None:
    with pytest.raises(openai.InternalServerError) as info:
        sdk(http_gateway, key).chat.completions.create(
            model="", messages=HI, max_tokens=32, extra_headers={"x-request-timeout": "0.001"}
        )
    assert info.value.status_code == 504
    assert info.value.code == "deadline_exceeded"


@pytest.fixture
def no_engine_gateway(
    tokenizer_server: ManagedProcess,
    gw_redis: RedisServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[HttpGateway]:
    hg = start_http_gateway(
        "gateway-no-engine",
        [f"127.0.0.1:{free_port()}"],
        tokenizer_server.address,
        gw_redis.url,
        tmp_path_factory.mktemp("gateway-no-engine"),
        env={"LLM_GATEWAY_STARTUP_WAIT_S": "0"},
    )
    try:
        yield hg
    finally:
        hg.gw.stop()


def test_no_engine_is_503(no_engine_gateway: HttpGateway) -> None:
    _, key = no_engine_gateway.gw.tenant()
    with pytest.raises(openai.InternalServerError) as info:
        sdk(no_engine_gateway, key).chat.completions.create(model="", messages=HI)
    assert isinstance(info.value, openai.APIStatusError)
    assert info.value.status_code == 503
    assert info.value.code == "service_unavailable"


def test_disconnect_mid_stream_frees_the_engine(
    http_gateway: HttpGateway, engines: EnginePair
) -> None:
    gw = http_gateway.gw
    tid, key = gw.tenant(max_concurrent=1)
    stream = sdk(http_gateway, key).chat.completions.create(
        model="", messages=HI, max_tokens=64, stream=True, extra_body={"ignore_eos": True}
    )
    got = [c for _, c in zip(range(3), stream, strict=False)]
    assert len(got) == 3
    assert gw.usage(tid).concurrent_in_use == 1
    stream.close()  # the client goes away mid-stream
    wait_for(lambda: gw.usage(tid).concurrent_in_use == 0)
    assert gw.usage(tid).completion_tokens_total < 64  # settled with what was produced

    def engines_idle() -> bool:
        for address in engines.addresses:
            with grpc.insecure_channel(address) as ch:
                stats = engine_pb2_grpc.EngineStub(ch).GetStats(engine_pb2.GetStatsRequest())
                if stats.num_running or stats.num_waiting:
                    return False
        return True

    wait_for(engines_idle)
    assert gw.metric("gateway_requests_total", tenant=tid, code="CANCELLED") == 1


def test_every_http_response_carries_openai_s_ratelimit_headers(http_gateway: HttpGateway) -> None:
    """On a JSON answer, a streamed one and a 429 alike (read with the openai SDK)."""
    _, key = http_gateway.gw.tenant(  # one a minute: nothing refills during the test
        requests_per_minute=1, request_burst=3, tokens_per_minute=100_000
    )
    client = sdk(http_gateway, key)
    plain = client.completions.with_raw_response.create(model="", prompt="Hi", max_tokens=1)
    assert plain.headers["x-ratelimit-limit-requests"] == "1"
    assert plain.headers["x-ratelimit-remaining-requests"] == "2"
    assert plain.headers["x-ratelimit-limit-tokens"] == "100000"
    with client.completions.with_streaming_response.create(
        model="", prompt="Hi", max_tokens=1, stream=True
    ) as streamed:
        assert streamed.headers["x-ratelimit-remaining-requests"] == "1"
        assert "x-ratelimit-reset-tokens" in streamed.headers
        streamed.read()
    client.completions.create(model="", prompt="Hi", max_tokens=1)
    with pytest.raises(openai.RateLimitError) as info:
        client.completions.create(model="", prompt="Hi", max_tokens=1)
    headers = info.value.response.headers
    assert headers["x-ratelimit-remaining-requests"] == "0"
    assert headers["x-ratelimit-reset-requests"].endswith("s")
