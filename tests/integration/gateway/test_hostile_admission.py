"""Admission under hostile load against the real stack: one Redis call with headroom,
an overlapped admission Redis refuses or whose client goes away, and refused prompts
that still spend request units; nothing is held afterwards.
"""

from __future__ import annotations

import grpc
import pytest

from llm.v1 import gateway_pb2
from tests.integration.gateway.conftest import (
    EnginePair,
    GatewayProcess,
    HttpGateway,
    chat,
)
from tests.integration.gateway.hostile_helpers import (
    assert_idle,
    stage_count,
    wait_until,
)

pytestmark = pytest.mark.integration


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
