"""Usage records through the gateway: every finished request lands in its tenant x key x
model x version x day record (tokens equal to what the responses reported, refusals as
errors by status, cost from the price table), exportable as CSV/JSON, and kept after the
tenant is deleted."""

from __future__ import annotations

import csv
import io
import json
import time

import grpc
import pytest

from llm.v1 import admin_pb2, common_pb2, gateway_pb2
from tests.integration.gateway.conftest import GatewayProcess

pytestmark = pytest.mark.integration


def records(gw: GatewayProcess, tenant_id: str, want_requests: int) -> list[admin_pb2.UsageRecord]:
    """The tenant's records once they hold ``want_requests`` (written in the background)."""
    got: list[admin_pb2.UsageRecord] = []
    for _ in range(100):
        got = list(
            gw.admin.QueryUsage(
                admin_pb2.QueryUsageRequest(tenant_id=tenant_id), metadata=gw.admin_md
            ).records
        )
        if sum(r.requests for r in got) >= want_requests:
            return got
        time.sleep(0.1)
    raise AssertionError(f"usage records of {tenant_id} never reached {want_requests}: {got}")


def test_requests_land_in_usage_records_that_outlive_the_tenant(gateway: GatewayProcess) -> None:
    tid, key = gateway.tenant(requests_per_minute=2, request_burst=2)
    key_id = (
        gateway.admin.ListApiKeys(
            admin_pb2.ListApiKeysRequest(tenant_id=tid), metadata=gateway.admin_md
        )
        .api_keys[0]
        .key_id
    )
    req = gateway_pb2.GenerateRequest(
        prompt="Count to three:",
        sampling=common_pb2.SamplingParams(max_tokens=5, ignore_eos=True),
    )
    finals = [gateway.generate(key, req)[-1] for _ in range(2)]
    with pytest.raises(grpc.RpcError) as info:  # the third is over the request rate
        gateway.generate(key, req)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    got = records(gateway, tid, 3)
    served = [r for r in got if r.model]
    assert len(served) == 1
    rec = served[0]
    assert (rec.tenant_id, rec.key_id, rec.date) == (
        tid,
        key_id,
        time.strftime("%Y-%m-%d", time.gmtime()),
    )
    assert rec.requests == 2
    assert rec.prompt_tokens == sum(f.usage.prompt_tokens for f in finals)
    assert rec.completion_tokens == sum(f.usage.completion_tokens for f in finals) == 10
    # the suite's price table: 0.001 USD per prompt token, 0.002 per completion token
    assert rec.cost_usd == pytest.approx(rec.prompt_tokens * 0.001 + rec.completion_tokens * 0.002)
    # the refusal is a request of that key too, ended RESOURCE_EXHAUSTED before any model
    refused = [r for r in got if not r.model]
    assert [dict(r.errors) for r in refused] == [{"RESOURCE_EXHAUSTED": 1}]
    assert refused[0].requests == 1
    # CSV export through the same API
    body = gateway.admin.ExportUsage(
        admin_pb2.QueryUsageRequest(tenant_id=tid, format="csv"), metadata=gateway.admin_md
    )
    assert body.content_type.startswith("text/csv")
    rows = list(csv.DictReader(io.StringIO(body.data.decode())))
    assert {r["key_id"] for r in rows} == {key_id}
    assert sum(int(r["requests"]) for r in rows) == 3
    # deleting the tenant (and so its keys) keeps the records
    gateway.admin.DeleteTenant(
        admin_pb2.DeleteTenantRequest(tenant_id=tid), metadata=gateway.admin_md
    )
    after = json.loads(
        gateway.admin.ExportUsage(
            admin_pb2.QueryUsageRequest(tenant_id=tid, format="json"), metadata=gateway.admin_md
        ).data
    )
    assert sum(r["requests"] for r in after) == 3
    # and a query over every tenant still lists it
    everyone = gateway.admin.QueryUsage(admin_pb2.QueryUsageRequest(), metadata=gateway.admin_md)
    assert tid in {r.tenant_id for r in everyone.records}


def test_bad_usage_queries_say_what_to_fix(gateway: GatewayProcess) -> None:
    cases = [
        (admin_pb2.QueryUsageRequest(start_date="yesterday"), "YYYY-MM-DD"),
        (admin_pb2.QueryUsageRequest(start_date="2026-02-01", end_date="2026-01-01"), "after"),
        (admin_pb2.QueryUsageRequest(start_date="2020-01-01", end_date="2026-01-01"), "400"),
    ]
    for req, match in cases:
        with pytest.raises(grpc.RpcError) as info:
            gateway.admin.QueryUsage(req, metadata=gateway.admin_md)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert match in (info.value.details() or "")
    with pytest.raises(grpc.RpcError) as info:
        gateway.admin.ExportUsage(
            admin_pb2.QueryUsageRequest(format="xml"), metadata=gateway.admin_md
        )
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
