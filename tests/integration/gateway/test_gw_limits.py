"""Tenant limits through the gateway (real Redis): RPM, TPM, concurrency, cancel settles."""

from __future__ import annotations

import time

import grpc
import pytest

from llm.v1 import common_pb2, engine_pb2, engine_pb2_grpc, gateway_pb2
from tests.integration.gateway.conftest import EnginePair, GatewayProcess, chat, trailers

pytestmark = pytest.mark.integration


def denied(gateway: GatewayProcess, key: str, req: gateway_pb2.GenerateRequest) -> tuple[str, int]:
    """(details, retry-after-ms) of a RESOURCE_EXHAUSTED answer."""
    with pytest.raises(grpc.RpcError) as info:
        gateway.generate(key, req)
    err = info.value
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.details()
    md = trailers(err)
    assert "grpc-status-details-bin" in md  # QuotaFailure + RetryInfo
    return err.details() or "", int(md["retry-after-ms"])


def prompt(max_tokens: int) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        prompt="Hello", sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    )


def test_requests_per_minute(gateway: GatewayProcess) -> None:
    tid, key = gateway.tenant(requests_per_minute=60, request_burst=1)
    assert gateway.generate(key, prompt(2))[-1].finish_reason == common_pb2.LENGTH
    details, retry_ms = denied(gateway, key, prompt(2))
    assert "requests_per_minute" in details
    assert 0 < retry_ms <= 1000
    # at once again: answered from the gateway's memo of that denial (no tokenizer call,
    # no Redis), same details, a wait that has not grown
    details2, retry_ms2 = denied(gateway, key, prompt(2))
    assert "requests_per_minute" in details2  # the message gives the remaining wait
    assert 0 < retry_ms2 <= retry_ms
    assert gateway.metric("gateway_ratelimit_local_denials_total", tenant=tid) == 1
    time.sleep(retry_ms2 / 1000)
    assert gateway.generate(key, prompt(2))[-1].finish_reason == common_pb2.LENGTH
    assert gateway.metric("gateway_ratelimit_denials_total", tenant=tid, dimension="requests") == 2


def test_the_request_rate_is_checked_before_the_prompt_is_tokenized(
    gateway: GatewayProcess,
) -> None:
    """Over both the request and the token rate: the answer names only the request rate
    (the request unit is taken before the tokenizer runs, so the tokens were never
    counted), and the next calls are refused by the gateway itself for that wait."""
    tid, key = gateway.tenant(
        requests_per_minute=6, request_burst=1, tokens_per_minute=60, token_burst=50
    )
    assert gateway.generate(key, prompt(40))[-1].finish_reason == common_pb2.LENGTH  # 9 left
    details, retry_ms = denied(gateway, key, prompt(30))
    assert "requests_per_minute" in details
    assert "tokens_per_minute" not in details
    assert 0 < retry_ms <= 10_000  # one request at 6/min
    details2, retry_ms2 = denied(gateway, key, prompt(30))
    assert "requests_per_minute" in details2
    assert 0 < retry_ms2 <= retry_ms
    assert gateway.metric("gateway_ratelimit_local_denials_total", tenant=tid) == 1
    usage = gateway.usage(tid)
    assert usage.concurrent_in_use == 0


def test_tokens_per_minute(gateway: GatewayProcess) -> None:
    tid, key = gateway.tenant(tokens_per_minute=1200, token_burst=50)
    first = gateway.stub.Generate(
        prompt(40), metadata=(("authorization", f"Bearer {key}"),), timeout=60
    )
    next(iter(first))  # 1 + 40 tokens reserved, 9 left in the bucket
    details, retry_ms = denied(gateway, key, prompt(40))
    assert "tokens_per_minute" in details
    assert "needs 41" in details
    assert retry_ms > 0
    time.sleep(retry_ms / 1000)
    assert gateway.generate(key, prompt(40))[-1].usage.completion_tokens == 40
    assert list(first)[-1].usage.completion_tokens == 40
    assert gateway.metric("gateway_ratelimit_denials_total", tenant=tid, dimension="tokens") == 1
    usage = gateway.usage(tid)
    assert usage.completion_tokens_total == 80  # settled with what was produced


def test_too_big_for_the_bucket_never_fits(gateway: GatewayProcess) -> None:
    _, key = gateway.tenant(tokens_per_minute=20)
    with pytest.raises(grpc.RpcError) as info:
        gateway.generate(key, prompt(40))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "lower max_tokens" in (info.value.details() or "")
    assert "retry-after-ms" not in trailers(info.value)


def test_max_concurrent(gateway: GatewayProcess) -> None:
    tid, key = gateway.tenant(max_concurrent=1)
    first = gateway.stub.Generate(
        prompt(48), metadata=(("authorization", f"Bearer {key}"),), timeout=60
    )
    next(iter(first))  # admitted and streaming
    details, retry_ms = denied(gateway, key, prompt(2))
    assert "max_concurrent" in details
    rest = list(first)
    assert rest[-1].usage.completion_tokens == 48
    time.sleep(retry_ms / 1000)
    assert gateway.generate(key, prompt(2))[-1].finish_reason == common_pb2.LENGTH
    assert (
        gateway.metric("gateway_ratelimit_denials_total", tenant=tid, dimension="concurrency") == 1
    )


def wait_for(fn: object, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not fn():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


def test_cancel_releases_lease_and_settles(gateway: GatewayProcess, engines: EnginePair) -> None:
    tid, key = gateway.tenant(max_concurrent=1, tokens_per_minute=100_000)
    call = gateway.stub.Generate(
        prompt(64), metadata=(("authorization", f"Bearer {key}"),), timeout=60
    )
    got = [t for _, chunk in zip(range(3), call, strict=False) for t in chunk.token_ids]
    assert gateway.usage(tid).concurrent_in_use == 1
    call.cancel()  # type: ignore[no-untyped-call]
    wait_for(lambda: gateway.usage(tid).concurrent_in_use == 0)
    usage = gateway.usage(tid)
    assert usage.prompt_tokens_total > 0
    assert len(got) <= usage.completion_tokens_total < 64  # produced tokens, not max_tokens
    assert usage.tokens_available == pytest.approx(  # the unused reservation came back
        100_000 - usage.prompt_tokens_total - usage.completion_tokens_total, abs=50
    )

    def engines_idle() -> bool:
        for address in engines.addresses:
            with grpc.insecure_channel(address) as ch:
                stats = engine_pb2_grpc.EngineStub(ch).GetStats(engine_pb2.GetStatsRequest())
                if stats.num_running or stats.num_waiting:
                    return False
        return True

    wait_for(engines_idle)  # the engine call was cancelled and its request aborted
    assert gateway.generate(key, chat("hi", max_tokens=1))[-1].finish_reason


def test_answers_and_refusals_carry_openai_s_ratelimit_metadata(gateway: GatewayProcess) -> None:
    """x-ratelimit-{limit,remaining,reset}-{requests,tokens} in the initial metadata of a
    stream and in the trailers of a refusal; a tenant without limits gets none."""
    # one request a minute: nothing refills while the test runs, however slow the machine
    _, key = gateway.tenant(requests_per_minute=1, request_burst=2, tokens_per_minute=100_000)
    md = (("authorization", f"Bearer {key}"),)
    call = gateway.stub.Generate(chat("Hi", 2), metadata=md, timeout=60)
    assert list(call)
    head = {k: str(v) for k, v in call.initial_metadata() or ()}
    assert head["x-ratelimit-limit-requests"] == "1"
    assert head["x-ratelimit-remaining-requests"] == "1"
    assert head["x-ratelimit-reset-requests"].endswith("s")
    assert head["x-ratelimit-limit-tokens"] == "100000"
    assert 0 < int(head["x-ratelimit-remaining-tokens"]) < 100_000  # prompt + 2 taken
    assert gateway.generate(key, chat("Hi", 1))
    with pytest.raises(grpc.RpcError) as err:
        gateway.generate(key, chat("Hi", 1))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    tail = trailers(err.value)
    assert tail["x-ratelimit-remaining-requests"] == "0"
    assert tail["x-ratelimit-limit-requests"] == "1"
    _, free_key = gateway.tenant()
    call = gateway.stub.Generate(
        chat("Hi", 1), metadata=(("authorization", f"Bearer {free_key}"),), timeout=60
    )
    assert list(call)
    assert not any(k.startswith("x-ratelimit-") for k, _ in call.initial_metadata() or ())
