"""A request a budget refuses starts no engine work, on every admission path (the
overlapped one included): the engines' own request counters do not move."""

from __future__ import annotations

import grpc
import pytest

from llm.v1 import admin_pb2, common_pb2, engine_pb2, engine_pb2_grpc, gateway_pb2
from tests.integration.gateway.conftest import EnginePair, GatewayProcess
from tests.integration.gateway.hostile_helpers import assert_idle

pytestmark = pytest.mark.integration

TOKENS = admin_pb2.BudgetMetric.Value("BUDGET_TOKENS")
HOUR = admin_pb2.BudgetPeriod.Value("BUDGET_HOUR")


def req(max_tokens: int) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        prompt="Hello there",
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
    )


def engine_requests(engines: EnginePair) -> int:
    """Requests the engines have taken since they started (their own counters)."""
    total = 0
    for address in engines.addresses:
        with grpc.insecure_channel(address) as ch:
            stats = engine_pb2_grpc.EngineStub(ch).GetStats(engine_pb2.GetStatsRequest())
            total += stats.num_requests_total
    return total


def test_a_budget_refused_request_starts_no_engine_work(
    gateway: GatewayProcess, engines: EnginePair
) -> None:
    tid, key = gateway.tenant(requests_per_minute=600, max_concurrent=8)
    t = gateway.admin.GetTenant(
        admin_pb2.GetTenantRequest(tenant_id=tid), metadata=gateway.admin_md
    )
    t.budgets.append(admin_pb2.Budget(name="hourly", metric=TOKENS, period=HOUR, limit=30))
    gateway.admin.UpsertTenant(t, metadata=gateway.admin_md)
    for _ in range(2):  # fits, and leaves the tenant headroom on its limits (one call)
        assert gateway.generate(key, req(2))[-1].usage.completion_tokens == 2
    overlapped = gateway.metric("gateway_ratelimit_overlapped_admissions_total")
    before = engine_requests(engines)
    for _ in range(3):  # prompt + 30 cannot fit what is left of 30 tokens this hour
        with pytest.raises(grpc.RpcError) as err:
            gateway.generate(key, req(30))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "budget 'hourly'" in (err.value.details() or "")
    assert engine_requests(engines) == before
    # the limits had room for the one-call path: none of these overlapped the engine
    assert gateway.metric("gateway_ratelimit_overlapped_admissions_total") == overlapped
    assert_idle(gateway, tid, engines)
