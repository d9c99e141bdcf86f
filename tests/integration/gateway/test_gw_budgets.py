"""Tenant budgets through the gateway (real Redis, real engines): exact settlement,
refusal naming the budget with retry-after on both fronts, the soft-threshold header,
cost budgets from the price table, reset, and no reservation left open."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import grpc
import pytest
from google.protobuf import field_mask_pb2
from redis import Redis

from common.redis_server import RedisServer
from llm.v1 import admin_pb2, common_pb2, gateway_pb2
from tests.integration.gateway.conftest import GatewayProcess, HttpGateway, trailers

pytestmark = pytest.mark.integration

TOKENS = admin_pb2.BudgetMetric.Value("BUDGET_TOKENS")
USD = admin_pb2.BudgetMetric.Value("BUDGET_COST_USD")
DAY = admin_pb2.BudgetPeriod.Value("BUDGET_DAY")
HOUR = admin_pb2.BudgetPeriod.Value("BUDGET_HOUR")


def with_budgets(gw: GatewayProcess, *budgets: admin_pb2.Budget) -> tuple[str, str]:
    tid, key = gw.tenant()
    t = gw.admin.GetTenant(admin_pb2.GetTenantRequest(tenant_id=tid), metadata=gw.admin_md)
    t.budgets.extend(budgets)
    gw.admin.UpsertTenant(t, metadata=gw.admin_md)
    return tid, key


def req(max_tokens: int) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        prompt="Hello there",
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
    )


def used(gw: GatewayProcess, tid: str) -> dict[str, float]:
    return {b.budget.name: b.used for b in gw.usage(tid).budgets}


def open_holds(redis_url: str, tid: str) -> int:
    with Redis.from_url(redis_url, decode_responses=True) as r:
        return int(r.hlen(f"rl:{{{tid}}}:Bh"))


def test_token_budget_settles_exactly_and_refuses_with_the_reset_time(
    gateway: GatewayProcess, gw_redis: RedisServer
) -> None:
    budget = admin_pb2.Budget(name="daily", metric=TOKENS, period=DAY, limit=40)
    tid, key = with_budgets(gateway, budget)
    spent = 0
    for _ in range(2):
        last = gateway.generate(key, req(6))[-1]
        spent += last.usage.prompt_tokens + last.usage.completion_tokens
    assert last.usage.completion_tokens == 6
    # reserved prompt + 6 each time, settled to exactly what was used
    assert used(gateway, tid)["daily"] == spent
    assert open_holds(gw_redis.url, tid) == 0
    # the next request's reservation (prompt + 30) does not fit what is left
    with pytest.raises(grpc.RpcError) as info:
        gateway.generate(key, req(30))
    err = info.value
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    details = err.details() or ""
    assert "budget 'daily'" in details
    assert "40 tokens per calendar day (UTC)" in details
    assert f"{spent} tokens used" in details
    retry_ms = int(trailers(err)["retry-after-ms"])
    midnight_ms = (86_400 - time.time() % 86_400) * 1000
    assert 0 < retry_ms <= midnight_ms + 1000
    assert abs(retry_ms - midnight_ms) < 120_000
    # a refusal charges nothing; a request that fits still passes
    assert used(gateway, tid)["daily"] == spent
    assert gateway.generate(key, req(1))[-1].usage.completion_tokens == 1
    assert (
        gateway.metric("ratelimit_budget_events_total", tenant=tid, budget="daily", event="refused")
        == 1
    )
    # ResetLimits with budgets zeroes the period's count
    gateway.admin.ResetLimits(
        admin_pb2.ResetLimitsRequest(tenant_id=tid, budgets=True), metadata=gateway.admin_md
    )
    assert used(gateway, tid)["daily"] == 0
    assert gateway.generate(key, req(30))[-1].usage.completion_tokens == 30
    assert open_holds(gw_redis.url, tid) == 0


def test_soft_threshold_sends_a_warning_header_and_counts(gateway: GatewayProcess) -> None:
    budget = admin_pb2.Budget(
        name="hourly", metric=TOKENS, period=HOUR, limit=1000, rolling=True, warn_percent=1
    )
    tid, key = with_budgets(gateway, budget)
    calls = gateway.stub.Generate(req(12), metadata=(("authorization", f"Bearer {key}"),))
    list(calls)
    md = dict(calls.initial_metadata())
    assert "hourly:" in md["x-budget-warning"]
    assert "of 1000 tokens used" in md["x-budget-warning"]
    assert (
        gateway.metric("ratelimit_budget_events_total", tenant=tid, budget="hourly", event="warned")
        == 1
    )
    (status,) = gateway.usage(tid).budgets
    assert status.remaining == 1000 - status.used
    # rolling: the newest slot stops counting between one hour and one hour plus a minute
    assert 3600 <= status.resets_at.seconds - time.time() <= 3660 + 5


def test_cost_budget_charges_by_the_price_table(gateway: GatewayProcess) -> None:
    # the suite's price: 0.001 USD per prompt token, 0.002 per completion token
    budget = admin_pb2.Budget(name="spend", metric=USD, period=DAY, limit=0.05)
    tid, key = with_budgets(gateway, budget)
    last = gateway.generate(key, req(4))[-1]
    cost = last.usage.prompt_tokens * 0.001 + last.usage.completion_tokens * 0.002
    assert used(gateway, tid)["spend"] == pytest.approx(cost)
    with pytest.raises(grpc.RpcError) as info:
        gateway.generate(key, req(25))  # 0.05 USD of output alone
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "USD" in (info.value.details() or "")


def chat_call(base_url: str, key: str, max_tokens: int) -> urllib.request.Request:
    body = {"model": "", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": max_tokens}
    return urllib.request.Request(
        f"{base_url}/chat/completions",
        data=json.dumps(body).encode(),
        headers={"authorization": f"Bearer {key}", "content-type": "application/json"},
    )


def refused(request: urllib.request.Request) -> urllib.error.HTTPError:
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=30)
    assert info.value.code == 429
    return info.value


def test_http_front_answers_429_with_retry_after_naming_the_budget(
    http_gateway: HttpGateway,
) -> None:
    gw, url = http_gateway.gw, http_gateway.base_url
    budget = admin_pb2.Budget(name="small", metric=TOKENS, period=DAY, limit=100)
    _, key = with_budgets(gw, budget)
    with urllib.request.urlopen(chat_call(url, key, 10), timeout=60) as resp:
        total = json.loads(resp.read())["usage"]["total_tokens"]
    assert total < 100
    err = refused(chat_call(url, key, 64))
    retry_s = int(err.headers["retry-after"])
    assert abs(retry_s - (86_400 - time.time() % 86_400)) < 120
    message = json.loads(err.read())["error"]["message"]
    assert "budget 'small'" in message
    assert f"{total} tokens used" in message
    # a request alone over the limit: no Retry-After, and the message says why
    _, key = with_budgets(gw, admin_pb2.Budget(name="tiny", metric=TOKENS, period=DAY, limit=5))
    err = refused(chat_call(url, key, 10))
    assert "retry-after" not in err.headers
    assert "can never fit" in json.loads(err.read())["error"]["message"]


def test_a_keys_own_budget_limits_that_key_only(gateway: GatewayProcess) -> None:
    tid, other_key = gateway.tenant()
    created = gateway.admin.CreateApiKey(
        admin_pb2.CreateApiKeyRequest(
            tenant_id=tid,
            name="batch",
            budgets=[admin_pb2.Budget(name="daily", metric=TOKENS, period=DAY, limit=30)],
        ),
        metadata=gateway.admin_md,
    )
    key, key_id = created.key, created.api_key.key_id
    assert created.api_key.budgets[0].name == "daily"
    spent = 0
    last = gateway.generate(key, req(6))[-1]
    spent += last.usage.prompt_tokens + last.usage.completion_tokens
    with pytest.raises(grpc.RpcError) as info:
        gateway.generate(key, req(30))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"API key {key_id} of tenant '{tid}' is over its budget 'daily'" in (
        info.value.details() or ""
    )
    # the tenant's other key has no budget of its own: it is not held back
    assert gateway.generate(other_key, req(30))[-1].usage.completion_tokens == 30
    (status,) = gateway.usage(tid).budgets
    assert (status.key_id, status.budget.name, status.used) == (key_id, "daily", spent)
    # dropping the key's budgets (a partial update of the key) lets it through again
    gateway.admin.UpdateApiKey(
        admin_pb2.UpdateApiKeyRequest(
            api_key=admin_pb2.ApiKey(key_id=key_id),
            update_mask=field_mask_pb2.FieldMask(paths=["budgets"]),
        ),
        metadata=gateway.admin_md,
    )
    # (the replica that made the change drops its auth cache at once)
    assert gateway.generate(key, req(30))[-1].usage.completion_tokens == 30
