"""RateLimitAdmin over a real in-process grpc.aio server and a real Redis."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import grpc
import pytest
from google.protobuf import field_mask_pb2, timestamp_pb2

from common.redis_server import RedisServer
from llm.v1 import admin_pb2, admin_pb2_grpc, common_pb2
from ratelimit.admin.servicer import add_to_server
from ratelimit.config import RateLimitConfig
from ratelimit.errors import PermissionDeniedError
from ratelimit.factory import RateLimitStack

pytestmark = pytest.mark.integration

ADMIN_KEY = "sk-llm-admin-key-for-the-admin-service-tests"
if TYPE_CHECKING:
    Stub = admin_pb2_grpc.RateLimitAdminAsyncStub
AUTH = (("authorization", f"Bearer {ADMIN_KEY}"),)


@pytest.fixture
async def stack(redis_server: RedisServer, prefix: str) -> AsyncIterator[RateLimitStack]:
    config = RateLimitConfig(redis_url=redis_server.url, key_prefix=prefix, admin_key=ADMIN_KEY)
    stack = RateLimitStack.from_config(config)
    await stack.start(wait_s=5)
    try:
        yield stack
    finally:
        await stack.aclose()


@pytest.fixture
async def stub(stack: RateLimitStack) -> AsyncIterator[Stub]:
    server = grpc.aio.server()
    add_to_server(stack.servicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield admin_pb2_grpc.RateLimitAdminStub(channel)  # type: ignore[misc]
    finally:
        await channel.close(None)
        await server.stop(0)


async def expect(code: grpc.StatusCode, call: object, match: str = "") -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call  # type: ignore[misc]
    assert info.value.code() == code, info.value.details()
    assert match in (info.value.details() or "")


async def test_admin_calls_need_an_admin_key(stub: Stub, stack: RateLimitStack) -> None:
    req = admin_pb2.ListTenantsRequest()
    await expect(grpc.StatusCode.UNAUTHENTICATED, stub.ListTenants(req), "missing")
    bad = (("authorization", "Basic abc"),)
    await expect(grpc.StatusCode.UNAUTHENTICATED, stub.ListTenants(req, metadata=bad), "Bearer")
    unknown = (("authorization", "Bearer sk-llm-" + "x" * 40),)
    await expect(
        grpc.StatusCode.UNAUTHENTICATED, stub.ListTenants(req, metadata=unknown), "unknown"
    )
    await stub.UpsertTenant(admin_pb2.Tenant(id="acme"), metadata=AUTH)
    created = await stub.CreateApiKey(
        admin_pb2.CreateApiKeyRequest(tenant_id="acme", role=admin_pb2.TENANT), metadata=AUTH
    )
    tenant_auth = (("authorization", f"Bearer {created.key}"),)
    await expect(
        grpc.StatusCode.PERMISSION_DENIED, stub.ListTenants(req, metadata=tenant_auth), "ADMIN"
    )


async def test_tenant_key_usage_and_audit_flow(stub: Stub, stack: RateLimitStack) -> None:
    tenant = admin_pb2.Tenant(
        id="acme",
        limits=admin_pb2.LimitPolicy(
            requests_per_minute=60, tokens_per_minute=1000, max_concurrent=2
        ),
        priority=common_pb2.CRITICAL,
        allowed_models=["smol"],
        display_name="Acme",
    )
    stored = await stub.UpsertTenant(tenant, metadata=AUTH)
    assert stored.created_at.seconds > 0
    assert stored.priority == common_pb2.CRITICAL
    got = await stub.GetTenant(admin_pb2.GetTenantRequest(tenant_id="acme"), metadata=AUTH)
    assert got.limits.tokens_per_minute == 1000
    listed = await stub.ListTenants(admin_pb2.ListTenantsRequest(), metadata=AUTH)
    assert [t.id for t in listed.tenants] == ["acme"]

    created = await stub.CreateApiKey(
        admin_pb2.CreateApiKeyRequest(tenant_id="acme", name="ci"), metadata=AUTH
    )
    assert created.key.startswith(created.api_key.display_prefix)
    keys = await stub.ListApiKeys(admin_pb2.ListApiKeysRequest(tenant_id="acme"), metadata=AUTH)
    assert [k.key_id for k in keys.api_keys] == [created.api_key.key_id]
    assert created.key not in str(keys)

    principal = await stack.registry.authenticate(created.key)
    assert principal.tenant is not None
    decision = await stack.limiter.reserve(principal.tenant, 300)
    assert decision.reservation is not None
    await stack.limiter.settle(decision.reservation, prompt_tokens=100, completion_tokens=50)
    usage = await stub.GetUsage(admin_pb2.GetUsageRequest(tenant_id="acme"), metadata=AUTH)
    assert 850 <= usage.tokens_available < 1000  # refills at ~16.7 tokens/s meanwhile
    assert 59 <= usage.requests_available < 60
    assert (usage.requests_total, usage.prompt_tokens_total, usage.completion_tokens_total) == (
        1,
        100,
        50,
    )
    await stub.ResetLimits(admin_pb2.ResetLimitsRequest(tenant_id="acme"), metadata=AUTH)
    usage = await stub.GetUsage(admin_pb2.GetUsageRequest(tenant_id="acme"), metadata=AUTH)
    assert (usage.tokens_available, usage.requests_available) == (1000, 60)

    revoked = await stub.RevokeApiKey(
        admin_pb2.RevokeApiKeyRequest(key_id=created.api_key.key_id), metadata=AUTH
    )
    assert revoked.api_key.revoked
    deleted = await stub.DeleteTenant(
        admin_pb2.DeleteTenantRequest(tenant_id="acme"), metadata=AUTH
    )
    assert deleted.num_keys_revoked == 0

    events = (await stub.ListAuditEvents(admin_pb2.ListAuditEventsRequest(), metadata=AUTH)).events
    actions = [e.action for e in reversed(events)]
    assert actions == [
        "UpsertTenant",
        "CreateApiKey",
        "ResetLimits",
        "RevokeApiKey",
        "DeleteTenant",
    ]
    admin = await stack.registry.authenticate(ADMIN_KEY, role=admin_pb2.ADMIN)  # type: ignore[arg-type]
    assert {e.actor for e in events} == {admin.key.key_id}
    assert json.loads(events[-1].detail)["limits"]["tokens_per_minute"] == 1000
    assert all(created.key not in e.detail for e in events)


async def test_bad_requests_have_actionable_statuses(stub: Stub) -> None:
    await expect(
        grpc.StatusCode.INVALID_ARGUMENT,
        stub.UpsertTenant(admin_pb2.Tenant(id="bad{id}"), metadata=AUTH),
        "invalid tenant id",
    )
    await expect(
        grpc.StatusCode.INVALID_ARGUMENT,
        stub.UpsertTenant(
            admin_pb2.Tenant(id="x", limits=admin_pb2.LimitPolicy(token_burst=5)), metadata=AUTH
        ),
        "token_burst is set",
    )
    await expect(
        grpc.StatusCode.NOT_FOUND,
        stub.GetUsage(admin_pb2.GetUsageRequest(tenant_id="ghost"), metadata=AUTH),
        "does not exist",
    )
    await expect(
        grpc.StatusCode.NOT_FOUND,
        stub.RevokeApiKey(admin_pb2.RevokeApiKeyRequest(key_id="key_nope"), metadata=AUTH),
    )
    await expect(
        grpc.StatusCode.INVALID_ARGUMENT,
        stub.CreateApiKey(admin_pb2.CreateApiKeyRequest(tenant_id="x", role=7), metadata=AUTH),  # type: ignore[arg-type]
        "unknown key role",
    )


async def test_budgets_round_trip_show_in_usage_and_are_validated(
    stub: Stub, stack: RateLimitStack
) -> None:
    day = admin_pb2.Budget(
        name="daily",
        metric=admin_pb2.BudgetMetric.Value("BUDGET_TOKENS"),
        period=admin_pb2.BudgetPeriod.Value("BUDGET_DAY"),
        limit=5000,
        timezone="Europe/Berlin",
        warn_percent=80,
    )
    spend = admin_pb2.Budget(
        name="spend",
        metric=admin_pb2.BudgetMetric.Value("BUDGET_COST_USD"),
        period=admin_pb2.BudgetPeriod.Value("BUDGET_MONTH"),
        limit=12.5,
        rolling=True,
    )
    out = await stub.UpsertTenant(admin_pb2.Tenant(id="b", budgets=[day, spend]), metadata=AUTH)
    utc_spend = admin_pb2.Budget()
    utc_spend.CopyFrom(spend)
    utc_spend.timezone = "UTC"  # "" = UTC, said explicitly in what is stored
    assert list(out.budgets) == [day, utc_spend]
    got = await stub.GetTenant(admin_pb2.GetTenantRequest(tenant_id="b"), metadata=AUTH)
    assert got.budgets == out.budgets
    usage = await stub.GetUsage(admin_pb2.GetUsageRequest(tenant_id="b"), metadata=AUTH)
    assert [(s.budget.name, s.used, s.remaining) for s in usage.budgets] == [
        ("daily", 0.0, 5000.0),
        ("spend", 0.0, 12.5),
    ]
    hour = admin_pb2.BudgetPeriod.Value("BUDGET_HOUR")
    bad = [
        (admin_pb2.Budget(name="x", period=hour, limit=0), "limit must be > 0"),
        (admin_pb2.Budget(name="x", limit=10), "set period"),
        (admin_pb2.Budget(name="x", period=hour, limit=10, timezone="Nowhere/City"), "time zone"),
        (admin_pb2.Budget(name="X Y", period=hour, limit=10), "invalid budget name"),
    ]
    for budget, match in bad:
        call = stub.UpsertTenant(admin_pb2.Tenant(id="b", budgets=[budget]), metadata=AUTH)
        await expect(grpc.StatusCode.INVALID_ARGUMENT, call, match)
    dup = stub.UpsertTenant(admin_pb2.Tenant(id="b", budgets=[day, day]), metadata=AUTH)
    await expect(grpc.StatusCode.INVALID_ARGUMENT, dup, "unique")
    # a refused change leaves the tenant as it was
    got = await stub.GetTenant(admin_pb2.GetTenantRequest(tenant_id="b"), metadata=AUTH)
    assert [b.name for b in got.budgets] == ["daily", "spend"]


async def test_update_tenant_changes_only_the_masked_fields(stub: Stub) -> None:
    limits = admin_pb2.LimitPolicy(requests_per_minute=60, tokens_per_minute=5000)
    await stub.UpsertTenant(
        admin_pb2.Tenant(id="u", limits=limits, allowed_models=["m1"], display_name="U"),
        metadata=AUTH,
    )
    patch = admin_pb2.Tenant(
        id="u", limits=admin_pb2.LimitPolicy(requests_per_minute=5), display_name="ignored"
    )
    mask = field_mask_pb2.FieldMask(paths=["limits.requests_per_minute"])
    out = await stub.UpdateTenant(
        admin_pb2.UpdateTenantRequest(tenant=patch, update_mask=mask), metadata=AUTH
    )
    assert (out.limits.requests_per_minute, out.limits.tokens_per_minute) == (5, 5000)
    assert (list(out.allowed_models), out.display_name) == (["m1"], "U")
    # no mask: every field set in the patch (here the priority alone)
    patch = admin_pb2.Tenant(id="u", priority=common_pb2.Priority.Value("CRITICAL"))
    out = await stub.UpdateTenant(admin_pb2.UpdateTenantRequest(tenant=patch), metadata=AUTH)
    assert out.priority == common_pb2.Priority.Value("CRITICAL")
    assert out.limits.requests_per_minute == 5
    # a list named in the mask is replaced whole (here emptied: every model)
    mask = field_mask_pb2.FieldMask(paths=["allowed_models"])
    out = await stub.UpdateTenant(
        admin_pb2.UpdateTenantRequest(tenant=admin_pb2.Tenant(id="u"), update_mask=mask),
        metadata=AUTH,
    )
    assert list(out.allowed_models) == []
    for paths, match in ((["id"], "cannot change"), (["nope"], "lacks"), ([], "nothing")):
        req = admin_pb2.UpdateTenantRequest(
            tenant=admin_pb2.Tenant(id="u"), update_mask=field_mask_pb2.FieldMask(paths=paths)
        )
        await expect(grpc.StatusCode.INVALID_ARGUMENT, stub.UpdateTenant(req, metadata=AUTH), match)
    missing = admin_pb2.UpdateTenantRequest(tenant=admin_pb2.Tenant(id="ghost", display_name="x"))
    await expect(grpc.StatusCode.NOT_FOUND, stub.UpdateTenant(missing, metadata=AUTH))


async def test_key_lifecycle_metadata_expiry_rotation_last_use(
    stub: Stub, stack: RateLimitStack
) -> None:
    await stub.UpsertTenant(admin_pb2.Tenant(id="k"), metadata=AUTH)
    soon = timestamp_pb2.Timestamp(seconds=int(time.time()) + 3600)
    created = await stub.CreateApiKey(
        admin_pb2.CreateApiKeyRequest(
            tenant_id="k", name="ci", owner="alice", description="nightly jobs", expires_at=soon
        ),
        metadata=AUTH,
    )
    key = created.api_key
    assert (key.owner, key.description, key.expires_at.seconds) == (
        "alice",
        "nightly jobs",
        soon.seconds,
    )
    past = timestamp_pb2.Timestamp(seconds=int(time.time()) - 10)
    call = stub.CreateApiKey(
        admin_pb2.CreateApiKeyRequest(tenant_id="k", expires_at=past), metadata=AUTH
    )
    await expect(grpc.StatusCode.INVALID_ARGUMENT, call, "in the past")
    # partial update: the owner only
    upd = await stub.UpdateApiKey(
        admin_pb2.UpdateApiKeyRequest(
            api_key=admin_pb2.ApiKey(key_id=key.key_id, owner="bob"),
            update_mask=field_mask_pb2.FieldMask(paths=["owner"]),
        ),
        metadata=AUTH,
    )
    assert (upd.owner, upd.description, upd.expires_at.seconds) == (
        "bob",
        "nightly jobs",
        soon.seconds,
    )
    move = stub.UpdateApiKey(
        admin_pb2.UpdateApiKeyRequest(
            api_key=admin_pb2.ApiKey(key_id=key.key_id, tenant_id="other"),
            update_mask=field_mask_pb2.FieldMask(paths=["tenant_id"]),
        ),
        metadata=AUTH,
    )
    await expect(grpc.StatusCode.INVALID_ARGUMENT, move, "cannot change")
    # a use is recorded (in the background, to the minute) and listed
    principal = await stack.registry.authenticate(created.key)
    assert principal.key.key_id == key.key_id
    for _ in range(100):
        keys = await stub.ListApiKeys(admin_pb2.ListApiKeysRequest(tenant_id="k"), metadata=AUTH)
        if keys.api_keys[0].last_used_at.seconds:
            break
        await asyncio.sleep(0.02)
    assert abs(keys.api_keys[0].last_used_at.seconds - time.time()) < 60
    # rotation: both keys work during the grace period, then only the new one
    rotated = await stub.RotateApiKey(
        admin_pb2.RotateApiKeyRequest(key_id=key.key_id, grace_seconds=1), metadata=AUTH
    )
    assert rotated.previous.rotated_to == rotated.api_key.key_id
    assert rotated.api_key.owner == "bob"
    assert rotated.previous.expires_at.seconds <= int(time.time()) + 1
    assert (await stack.registry.authenticate(rotated.key)).key.key_id == rotated.api_key.key_id
    await stack.registry.authenticate(created.key)  # within the grace period
    await asyncio.sleep(1.2)
    with pytest.raises(PermissionDeniedError, match=r"expired at .*replacement"):
        await stack.registry.authenticate(created.key)
    assert (await stack.registry.authenticate(rotated.key)).tenant is not None
    again = stub.RotateApiKey(admin_pb2.RotateApiKeyRequest(key_id=key.key_id), metadata=AUTH)
    await expect(grpc.StatusCode.INVALID_ARGUMENT, again, "revoked or expired")
    events = await stub.ListAuditEvents(admin_pb2.ListAuditEventsRequest(), metadata=AUTH)
    actions = [e.action for e in events.events]
    assert {"RotateApiKey", "UpdateApiKey", "CreateApiKey"} <= set(actions)
