"""Tenants and API keys in Redis, with a short local cache for authentication.

Keys (``<p>`` is the configured prefix; tenant data is hash-tagged by tenant)::

    <p>tenants               set     tenant ids
    <p>{<t>}:tenant          string  Tenant JSON
    <p>{<t>}:keys            set     key ids of the tenant
    <p>admin_keys            set     key ids of ADMIN keys
    <p>key:<sha256>          string  ApiKey JSON (looked up by the key's hash)
    <p>keyid:<key_id>        string  sha256 of that key
    <p>key_last_used         hash    key_id -> unix seconds of its last use (to the minute)

``authenticate`` goes through ``ratelimit.tenancy.key_cache.KeyCache``: answers are
reused for ``auth_cache_ttl_ms``, the bound on how long another replica
still honours a revoked key or an old policy.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from typing import Any

from common.log import get_logger
from ratelimit.budget.policy import Budget, validate_budgets
from ratelimit.config import Tenant, validate_tenant_id
from ratelimit.errors import NotFoundError
from ratelimit.redis_client import RedisClient, is_store_failure, store_errors
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
    validate_key_text,
)

LAST_USED_RESOLUTION_S = 60.0  # a key's last use is written at most once a minute per replica
KEY_FIELDS = ("name", "owner", "description", "expires_at", "budgets")  # UpdateApiKey may change

log = get_logger(__name__)


# Redis failures -> ``StoreError`` (UNAVAILABLE); the audit log, routing policies and
# model routes use it too
redis_errors = store_errors


class Registry:
    """Tenants and keys. All methods raise ``StoreError`` when Redis fails.

    Args:
        client: ``RedisClient`` (one server or a cluster) with ``decode_responses=True``.
        prefix: Key prefix shared with the limiter's store.
        auth_cache_ttl_ms: How long an authentication answer is reused.
        clock: Monotonic milliseconds (cache expiry).
        wall: Unix seconds: key expiry (checked on every authentication and when a key
            is created, updated or rotated) and the times the registry records.
    """

    def __init__(
        self,
        client: RedisClient,
        *,
        prefix: str = "rl:",
        auth_cache_ttl_ms: int = 5000,
        clock: Callable[[], float] | None = None,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.client = client
        self.prefix = prefix
        self.wall = wall
        self.auth = KeyCache(
            self.lookup_hash,
            self.get_tenant,
            auth_cache_ttl_ms,
            clock,
            wall=wall,
            on_use=self.note_use,
        )
        self._last_written: dict[str, float] = {}  # key id -> monotonic time of the write
        self._background: set[asyncio.Task[None]] = set()

    def _tenant_key(self, tenant_id: str) -> str:
        return f"{self.prefix}{{{tenant_id}}}:tenant"

    def _tenant_keys_key(self, tenant_id: str) -> str:
        return f"{self.prefix}{{{tenant_id}}}:keys"

    async def upsert_tenant(self, tenant: Tenant) -> Tenant:
        """Create or replace a tenant; keeps ``created_at`` of an existing one."""
        now = self.wall()
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

    async def create_key(
        self,
        tenant_id: str,
        name: str,
        role: KeyRole,
        *,
        owner: str = "",
        description: str = "",
        expires_at: float = 0.0,
        budgets: tuple[Budget, ...] = (),
    ) -> tuple[str, ApiKey]:
        """Issue a key; returns (plaintext, record). The plaintext is not stored.

        Raises:
            ValueError: text too long or not printable, or ``expires_at`` in the past.
        """
        validate_key_text(name=name, owner=owner, description=description)
        validate_budgets(f"API key {name!r}", budgets)
        if expires_at and expires_at <= self.wall():
            raise ValueError("expires_at is in the past; give a future time (or 0 = never)")
        role = KeyRole.TENANT if role == KeyRole.UNSPECIFIED else role
        if role == KeyRole.TENANT:
            await self.get_tenant(tenant_id)
        else:
            tenant_id = ""
        plaintext = generate_key()
        template = ApiKey(
            key_id="",
            tenant_id=tenant_id,
            name=name,
            display_prefix="",
            role=role,
            key_hash="",
            expires_at=expires_at,
            owner=owner,
            description=description,
            budgets=budgets,
        )
        return plaintext, await self._store_key(plaintext, template)

    async def update_key(self, key_id: str, changes: dict[str, Any]) -> ApiKey:
        """Change some of ``KEY_FIELDS`` of a key (others kept); ``expires_at`` 0 = never.

        Raises:
            ValueError: an unknown field, bad text, or an expiry in the past.
            NotFoundError: no such key.
        """
        unknown = set(changes) - set(KEY_FIELDS)
        if unknown:
            raise ValueError(f"cannot change {sorted(unknown)} of a key; only {list(KEY_FIELDS)}")
        key = await self.get_key(key_id)
        if key.revoked:
            raise ValueError(f"API key {key_id} is revoked; create a new key instead")
        updated = dataclasses.replace(key, **changes)
        validate_key_text(name=updated.name, owner=updated.owner, description=updated.description)
        validate_budgets(f"API key {key_id}", updated.budgets)
        updated = dataclasses.replace(updated, budgets=_owned(updated.budgets, updated.spends_as))
        if "expires_at" in changes and updated.expires_at and updated.expires_at <= self.wall():
            raise ValueError("expires_at is in the past; revoke the key to end it now")
        await self._save_key(updated, "update key")
        return updated

    async def rotate_key(self, key_id: str, grace_s: float) -> tuple[str, ApiKey, ApiKey]:
        """Issue a replacement of a key (same tenant, role, name, owner, description and
        budgets, whose spending so far it inherits: both keys count on one set of
        counters) and let the old one live ``grace_s`` more seconds (or less, if it
        expires sooner).
        Returns (new plaintext, new record, old record).

        Raises:
            ValueError: ``grace_s`` negative, or the key is revoked or expired.
            NotFoundError: no such key.
        """
        if grace_s < 0:
            raise ValueError(f"grace_seconds must be >= 0, got {grace_s}")
        old = await self.get_key(key_id)
        now = self.wall()
        if old.revoked or old.expired(now):
            raise ValueError(f"API key {key_id} is revoked or expired; create a new key instead")
        plaintext = generate_key()
        new = await self._store_key(  # its budgets count on the old key's counters
            plaintext,
            dataclasses.replace(
                old, revoked=False, expires_at=0.0, rotated_to="", budget_owner=old.spends_as
            ),
        )
        end = now + grace_s
        old = dataclasses.replace(
            old,
            expires_at=min(old.expires_at, end) if old.expires_at else end,
            rotated_to=new.key_id,
        )
        await self._save_key(old, "rotate key")
        return plaintext, new, old

    def note_use(self, key: ApiKey) -> None:
        """Record that ``key`` was used now, at most once a minute per key on this replica,
        in the background (authentication never waits on it; a failed write is dropped)."""
        mono = time.monotonic()
        last = self._last_written.get(key.key_id)
        if last is not None and mono - last < LAST_USED_RESOLUTION_S:
            return
        self._last_written[key.key_id] = mono
        if len(self._last_written) > 100_000:  # bounded: forget the oldest half
            for k in list(self._last_written)[:50_000]:
                del self._last_written[k]

        async def write() -> None:
            try:
                await self.client.hset(f"{self.prefix}key_last_used", key.key_id, self.wall())
            except Exception as exc:  # dropped, unless it is not the store's failure
                if not is_store_failure(exc):
                    raise

        task = asyncio.get_running_loop().create_task(write())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def last_used(self, key_ids: list[str]) -> dict[str, float]:
        """Unix seconds of each key's last use (keys never used are absent)."""
        if not key_ids:
            return {}
        with redis_errors("last used"):
            values = await self.client.hmget(f"{self.prefix}key_last_used", key_ids)
        return {k: float(v) for k, v in zip(key_ids, values, strict=True) if v is not None}

    async def ensure_admin_key(self, plaintext: str, name: str = "bootstrap") -> ApiKey:
        """Register a given admin key (bootstrap from config/env) unless it exists."""
        if not looks_like_key(plaintext):
            raise ValueError("the bootstrap admin key must look like sk-llm-<20+ url-safe chars>")
        with redis_errors("get key"):
            raw = await self._get(f"{self.prefix}key:{hash_key(plaintext)}")
        if raw is not None:
            return key_from_json(raw)
        return await self._store_key(plaintext, ApiKey("", "", name, "", KeyRole.ADMIN, ""))

    async def _store_key(self, plaintext: str, template: ApiKey) -> ApiKey:
        """Store a new key: ``template``'s tenant, name, role, owner, description and
        expiry, with a fresh id and the hash of ``plaintext``."""
        digest = hash_key(plaintext)
        key_id = new_key_id()
        key = dataclasses.replace(
            template,
            key_id=key_id,
            budgets=_owned(template.budgets, template.budget_owner or key_id),
            display_prefix=plaintext[:DISPLAY_PREFIX_LEN],
            key_hash=digest,
            created_at=self.wall(),
        )
        tenant_id = key.tenant_id
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
            key = dataclasses.replace(key, revoked=True, revoked_at=self.wall())
            await self._save_key(key, "revoke key")
        self.auth.clear()
        return key

    async def _save_key(self, key: ApiKey, op: str) -> None:
        with redis_errors(op):
            await self.client.set(f"{self.prefix}key:{key.key_hash}", key_to_json(key))
        self.auth.clear()

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


def _owned(budgets: tuple[Budget, ...], key_id: str) -> tuple[Budget, ...]:
    """The budgets as counted on the key ``key_id``'s counters."""
    return tuple(dataclasses.replace(b, owner=key_id) for b in budgets)


def _text(value: bytes | str | None) -> str | None:
    return value.decode() if isinstance(value, bytes) else value
