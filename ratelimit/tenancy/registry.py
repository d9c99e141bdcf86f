"""Tenants and API keys in Redis, with a short local cache for authentication.

Keys (``<p>`` is the configured prefix; tenant data is hash-tagged by tenant)::

    <p>tenants               set     tenant ids
    <p>{<t>}:tenant          string  Tenant JSON
    <p>{<t>}:keys            set     key ids of the tenant
    <p>admin_keys            set     key ids of ADMIN keys
    <p>key:<sha256>          string  ApiKey JSON (looked up by the key's hash)
    <p>keyid:<key_id>        string  sha256 of that key

``authenticate`` goes through ``ratelimit.tenancy.key_cache.KeyCache``: answers are
reused for ``auth_cache_ttl_ms``, the bound on how long another replica
still honours a revoked key or an old policy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator

from redis.asyncio import Redis
from redis.exceptions import RedisError

from common.log import get_logger
from ratelimit.config import Tenant, validate_tenant_id
from ratelimit.errors import NotFoundError, StoreError
from ratelimit.tenancy.key_cache import KeyCache
from ratelimit.tenancy.records import (
    DISPLAY_PREFIX_LEN,
    ApiKey,
    KeyRole,
    Principal,
    generate_key,
    hash_key,
    key_from_json,
    key_to_json,
    looks_like_key,
    new_key_id,
    tenant_from_json,
    tenant_to_json,
)

log = get_logger(__name__)


@contextlib.contextmanager
def redis_errors(op: str) -> Iterator[None]:
    """Turn Redis failures into ``StoreError`` (UNAVAILABLE)."""
    try:
        yield
    except RedisError as exc:
        raise StoreError(f"redis {op} failed: {type(exc).__name__}: {exc}") from exc


class Registry:
    """Tenants and keys. All methods raise ``StoreError`` when Redis fails.

    Args:
        client: ``redis.asyncio.Redis`` with ``decode_responses=True``.
        prefix: Key prefix shared with the limiter's store.
        auth_cache_ttl_ms: How long an authentication answer is reused.
        clock: Monotonic milliseconds (cache expiry).
    """

    def __init__(
        self,
        client: Redis,
        *,
        prefix: str = "rl:",
        auth_cache_ttl_ms: int = 5000,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.client = client
        self.prefix = prefix
        self.auth = KeyCache(self.lookup_hash, self.get_tenant, auth_cache_ttl_ms, clock)

    def _tenant_key(self, tenant_id: str) -> str:
        return f"{self.prefix}{{{tenant_id}}}:tenant"

    def _tenant_keys_key(self, tenant_id: str) -> str:
        return f"{self.prefix}{{{tenant_id}}}:keys"

    async def upsert_tenant(self, tenant: Tenant) -> Tenant:
        """Create or replace a tenant; keeps ``created_at`` of an existing one."""
        now = time.time()
        with redis_errors("upsert tenant"):
            raw = await self._get(self._tenant_key(tenant.tenant_id))
            created = tenant_from_json(raw).created_at if raw else now
            stored = dataclasses.replace(tenant, created_at=created, updated_at=now)
            await self.client.set(self._tenant_key(tenant.tenant_id), tenant_to_json(stored))
            await self.client.sadd(f"{self.prefix}tenants", tenant.tenant_id)
        self.auth.clear()
        return stored

    async def get_tenant(self, tenant_id: str) -> Tenant:
        """The tenant, or ``NotFoundError``."""
        validate_tenant_id(tenant_id)
        with redis_errors("get tenant"):
            raw = await self._get(self._tenant_key(tenant_id))
        if raw is None:
            raise NotFoundError(f"tenant {tenant_id!r} does not exist; create it with UpsertTenant")
        return tenant_from_json(raw)

    async def list_tenants(self) -> list[Tenant]:
        """Every tenant, sorted by id."""
        with redis_errors("list tenants"):
            ids = sorted(await self._members(f"{self.prefix}tenants"))
            pipe = self.client.pipeline(transaction=False)
            for tenant_id in ids:
                pipe.get(self._tenant_key(tenant_id))
            raws = await pipe.execute() if ids else []
        return [tenant_from_json(raw) for raw in raws if raw]

    async def delete_tenant(self, tenant_id: str) -> int:
        """Delete a tenant and revoke its keys; returns the number of keys revoked."""
        await self.get_tenant(tenant_id)
        with redis_errors("delete tenant"):
            key_ids = await self._members(self._tenant_keys_key(tenant_id))
        num_revoked = 0
        for key_id in sorted(key_ids):
            key = await self.get_key(key_id)
            if not key.revoked:
                await self.revoke_key(key_id)
                num_revoked += 1
        with redis_errors("delete tenant"):
            await self.client.delete(self._tenant_key(tenant_id), self._tenant_keys_key(tenant_id))
            await self.client.srem(f"{self.prefix}tenants", tenant_id)
        return num_revoked

    async def create_key(self, tenant_id: str, name: str, role: KeyRole) -> tuple[str, ApiKey]:
        """Issue a key; returns (plaintext, record). The plaintext is not stored."""
        role = KeyRole.TENANT if role == KeyRole.UNSPECIFIED else role
        if role == KeyRole.TENANT:
            await self.get_tenant(tenant_id)
        else:
            tenant_id = ""
        plaintext = generate_key()
        return plaintext, await self._store_key(plaintext, tenant_id, name, role)

    async def ensure_admin_key(self, plaintext: str, name: str = "bootstrap") -> ApiKey:
        """Register a given admin key (bootstrap from config/env) unless it exists."""
        if not looks_like_key(plaintext):
            raise ValueError("the bootstrap admin key must look like sk-llm-<20+ url-safe chars>")
        with redis_errors("get key"):
            raw = await self._get(f"{self.prefix}key:{hash_key(plaintext)}")
        if raw is not None:
            return key_from_json(raw)
        return await self._store_key(plaintext, "", name, KeyRole.ADMIN)

    async def _store_key(self, plaintext: str, tenant_id: str, name: str, role: KeyRole) -> ApiKey:
        digest = hash_key(plaintext)
        key = ApiKey(
            key_id=new_key_id(),
            tenant_id=tenant_id,
            name=name,
            display_prefix=plaintext[:DISPLAY_PREFIX_LEN],
            role=role,
            key_hash=digest,
            created_at=time.time(),
        )
        index = self._tenant_keys_key(tenant_id) if tenant_id else f"{self.prefix}admin_keys"
        with redis_errors("create key"):
            await self.client.set(f"{self.prefix}key:{digest}", key_to_json(key))
            await self.client.set(f"{self.prefix}keyid:{key.key_id}", digest)
            await self.client.sadd(index, key.key_id)
        self.auth.clear()
        return key

    async def get_key(self, key_id: str) -> ApiKey:
        """A key's record by its public id, or ``NotFoundError``."""
        with redis_errors("get key"):
            digest = await self._get(f"{self.prefix}keyid:{key_id}")
            raw = await self._get(f"{self.prefix}key:{digest}") if digest else None
        if raw is None:
            raise NotFoundError(f"API key {key_id!r} does not exist")
        return key_from_json(raw)

    async def revoke_key(self, key_id: str) -> ApiKey:
        """Revoke a key (idempotent). Other replicas stop accepting it within the cache TTL."""
        key = await self.get_key(key_id)
        if not key.revoked:
            key = dataclasses.replace(key, revoked=True, revoked_at=time.time())
            with redis_errors("revoke key"):
                await self.client.set(f"{self.prefix}key:{key.key_hash}", key_to_json(key))
        self.auth.clear()
        return key

    async def list_keys(self, tenant_id: str) -> list[ApiKey]:
        """Keys of a tenant (``""``: the ADMIN keys), oldest first."""
        if tenant_id:
            await self.get_tenant(tenant_id)
        index = self._tenant_keys_key(tenant_id) if tenant_id else f"{self.prefix}admin_keys"
        with redis_errors("list keys"):
            key_ids = await self._members(index)
        keys = [await self.get_key(key_id) for key_id in key_ids]
        return sorted(keys, key=lambda k: (k.created_at, k.key_id))

    async def authenticate(self, plaintext: str, role: KeyRole = KeyRole.TENANT) -> Principal:
        """Resolve a plaintext key to its principal, checking the required role.

        Answers are cached for ``auth_cache_ttl_ms`` (see ``ratelimit.tenancy.key_cache``).

        Raises:
            UnauthenticatedError: missing, malformed or unknown key.
            PermissionDeniedError: revoked key, deleted tenant, or the wrong role.
            StoreError: Redis failed and the answer is not cached.
        """
        return await self.auth.authenticate(plaintext, role)

    async def lookup_hash(self, digest: str) -> ApiKey | None:
        """The key record stored under a SHA-256, if any."""
        with redis_errors("authenticate"):
            raw = await self._get(f"{self.prefix}key:{digest}")
        return key_from_json(raw) if raw is not None else None

    async def _get(self, key: str) -> str | None:
        return _text(await self.client.get(key))

    async def _members(self, key: str) -> set[str]:
        return {_text(m) or "" for m in await self.client.smembers(key)}


def _text(value: bytes | str | None) -> str | None:
    return value.decode() if isinstance(value, bytes) else value
