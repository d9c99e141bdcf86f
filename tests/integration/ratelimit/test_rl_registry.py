"""Tenants, keys (hash only), authentication cache and revocation, audit log."""

from __future__ import annotations

import pytest
from redis.asyncio import Redis

from ratelimit.config import LimitPolicy, Priority, Tenant
from ratelimit.errors import NotFoundError, PermissionDeniedError, UnauthenticatedError
from ratelimit.tenancy.audit import AuditLog
from ratelimit.tenancy.records import KeyRole, hash_key
from ratelimit.tenancy.registry import Registry
from tests.support.clock import FakeClock

pytestmark = pytest.mark.integration

ACME = Tenant(
    "acme",
    LimitPolicy(requests_per_minute=60, tokens_per_minute=1000, max_concurrent=4),
    priority=Priority.CRITICAL,
    allowed_models=("smol",),
    display_name="Acme",
)


async def test_tenant_crud(redis_client: Redis, prefix: str) -> None:
    reg = Registry(redis_client, prefix=prefix)
    stored = await reg.upsert_tenant(ACME)
    assert stored.created_at > 0
    assert stored.updated_at == stored.created_at
    again = await reg.upsert_tenant(Tenant("acme", LimitPolicy(requests_per_minute=1)))
    assert again.created_at == stored.created_at
    assert (await reg.get_tenant("acme")).limits == LimitPolicy(requests_per_minute=1)
    await reg.upsert_tenant(Tenant("beta"))
    assert [t.tenant_id for t in await reg.list_tenants()] == ["acme", "beta"]
    with pytest.raises(NotFoundError, match="tenant 'nope' does not exist"):
        await reg.get_tenant("nope")
    with pytest.raises(ValueError, match="invalid tenant id"):
        await reg.get_tenant("bad{id}")


async def test_keys_are_stored_only_as_hashes(redis_client: Redis, prefix: str) -> None:
    reg = Registry(redis_client, prefix=prefix)
    await reg.upsert_tenant(ACME)
    plaintext, key = await reg.create_key("acme", "ci", KeyRole.UNSPECIFIED)
    assert key.role == KeyRole.TENANT
    assert plaintext.startswith(key.display_prefix)
    assert key.display_prefix.startswith("sk-llm-")
    dump = [await redis_client.get(k) for k in await redis_client.keys(f"{prefix}key*")]
    assert all(plaintext not in str(v) for v in dump)
    assert any(hash_key(plaintext) in str(v) for v in dump)
    principal = await reg.authenticate(plaintext)
    assert principal.tenant is not None
    assert principal.tenant.priority == Priority.CRITICAL
    assert principal.key.key_id == key.key_id
    assert [k.key_id for k in await reg.list_keys("acme")] == [key.key_id]


@pytest.mark.parametrize(
    ("presented", "error", "match"),
    [
        ("", UnauthenticatedError, "missing or malformed"),
        ("Bearer x", UnauthenticatedError, "missing or malformed"),
        ("sk-llm-" + "A" * 43, UnauthenticatedError, "unknown API key"),
    ],
)
async def test_bad_keys_are_unauthenticated(
    redis_client: Redis, prefix: str, presented: str, error: type[Exception], match: str
) -> None:
    reg = Registry(redis_client, prefix=prefix)
    with pytest.raises(error, match=match):
        await reg.authenticate(presented)


async def test_roles_are_separate(redis_client: Redis, prefix: str) -> None:
    reg = Registry(redis_client, prefix=prefix)
    await reg.upsert_tenant(ACME)
    tenant_key, _ = await reg.create_key("acme", "app", KeyRole.TENANT)
    admin_key, admin = await reg.create_key("ignored", "ops", KeyRole.ADMIN)
    assert admin.tenant_id == ""
    with pytest.raises(PermissionDeniedError, match="needs an ADMIN key"):
        await reg.authenticate(tenant_key, KeyRole.ADMIN)
    with pytest.raises(PermissionDeniedError, match="use a tenant key"):
        await reg.authenticate(admin_key, KeyRole.TENANT)
    assert (await reg.authenticate(admin_key, KeyRole.ADMIN)).tenant is None
    assert [k.key_id for k in await reg.list_keys("")] == [admin.key_id]


async def test_revocation_reaches_other_replicas_within_the_cache_ttl(
    redis_client: Redis, prefix: str
) -> None:
    clock = FakeClock()
    replica_a = Registry(redis_client, prefix=prefix, auth_cache_ttl_ms=2000, clock=clock)
    replica_b = Registry(redis_client, prefix=prefix, auth_cache_ttl_ms=2000, clock=clock)
    await replica_a.upsert_tenant(ACME)
    plaintext, key = await replica_a.create_key("acme", "app", KeyRole.TENANT)
    await replica_b.authenticate(plaintext)  # cached on B
    await replica_a.revoke_key(key.key_id)
    with pytest.raises(PermissionDeniedError, match="was revoked"):
        await replica_a.authenticate(plaintext)  # at once where it was revoked
    clock.now = 1999.0
    await replica_b.authenticate(plaintext)  # still inside B's bound
    clock.now = 2000.0
    with pytest.raises(PermissionDeniedError, match="was revoked"):
        await replica_b.authenticate(plaintext)
    assert (await replica_a.revoke_key(key.key_id)).revoked  # idempotent


async def test_keys_expire_on_the_injected_wall_clock(redis_client: Redis, prefix: str) -> None:
    wall = FakeClock(1_800_000_000.0)
    reg = Registry(redis_client, prefix=prefix, wall=wall)
    await reg.upsert_tenant(ACME)
    with pytest.raises(ValueError, match="in the past"):
        await reg.create_key("acme", "late", KeyRole.TENANT, expires_at=wall.now)
    plaintext, key = await reg.create_key("acme", "app", KeyRole.TENANT, expires_at=wall.now + 60)
    assert key.created_at == wall.now
    new_plaintext, new, old = await reg.rotate_key(key.key_id, grace_s=30)
    assert old.expires_at == wall.now + 30  # the grace ends before the key's own expiry
    wall.advance(29)
    await reg.authenticate(plaintext)  # inside the grace, and cached from here on
    wall.advance(1)
    with pytest.raises(PermissionDeniedError, match=f"expired.*{new.key_id}"):
        await reg.authenticate(plaintext)  # the cached answer expires on time too
    with pytest.raises(ValueError, match="revoked or expired"):
        await reg.rotate_key(key.key_id, grace_s=10)
    with pytest.raises(ValueError, match="in the past"):
        await reg.update_key(new.key_id, {"expires_at": wall.now - 1})
    assert (await reg.authenticate(new_plaintext)).tenant is not None


async def test_delete_tenant_revokes_its_keys(redis_client: Redis, prefix: str) -> None:
    reg = Registry(redis_client, prefix=prefix)
    await reg.upsert_tenant(ACME)
    k1, _ = await reg.create_key("acme", "a", KeyRole.TENANT)
    _, k2 = await reg.create_key("acme", "b", KeyRole.TENANT)
    await reg.revoke_key(k2.key_id)
    assert await reg.delete_tenant("acme") == 1
    with pytest.raises(PermissionDeniedError):
        await reg.authenticate(k1)
    assert await reg.list_tenants() == []
    with pytest.raises(NotFoundError):
        await reg.delete_tenant("acme")
    with pytest.raises(NotFoundError):
        await reg.create_key("acme", "c", KeyRole.TENANT)


async def test_bootstrap_admin_key_is_idempotent(redis_client: Redis, prefix: str) -> None:
    reg = Registry(redis_client, prefix=prefix)
    plaintext = "sk-llm-bootstrap-admin-key-for-tests-0001"
    first = await reg.ensure_admin_key(plaintext)
    second = await reg.ensure_admin_key(plaintext)
    assert first.key_id == second.key_id
    assert (await reg.authenticate(plaintext, KeyRole.ADMIN)).key.key_id == first.key_id
    with pytest.raises(ValueError, match="must look like"):
        await reg.ensure_admin_key("short")


async def test_audit_log_is_capped_and_newest_first(redis_client: Redis, prefix: str) -> None:
    audit = AuditLog(redis_client, prefix=prefix, max_events=3)
    for i in range(5):
        await audit.record("key_admin", "UpsertTenant", f"t{i}", {"i": i})
    events = await audit.list(10)
    assert [e.target for e in events] == ["t4", "t3", "t2"]
    assert events[0].actor == "key_admin"
    assert events[0].detail == '{"i": 4}'
