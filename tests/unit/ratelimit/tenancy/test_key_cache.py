"""The key cache: bounded LRUs, and made-up keys never evict valid ones."""

from __future__ import annotations

import asyncio
import dataclasses
from collections import Counter

import pytest

from ratelimit.config import Tenant
from ratelimit.errors import PermissionDeniedError, UnauthenticatedError
from ratelimit.tenancy import key_cache as auth
from ratelimit.tenancy.key_cache import KeyCache
from ratelimit.tenancy.records import ApiKey, KeyRole, generate_key, hash_key


class FakeStore:
    """Key records by hash, counting every lookup (each one a Redis round trip)."""

    def __init__(self, valid: list[str]) -> None:
        self.keys = {
            hash_key(k): ApiKey(f"key_{i}", "team", "k", k[:12], KeyRole.TENANT, hash_key(k))
            for i, k in enumerate(valid)
        }
        self.lookups: Counter[str] = Counter()

    async def lookup_hash(self, digest: str) -> ApiKey | None:
        self.lookups[digest] += 1
        return self.keys.get(digest)

    async def get_tenant(self, tenant_id: str) -> Tenant:
        return Tenant(tenant_id)


def test_a_spray_of_made_up_keys_never_evicts_a_valid_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(auth, "MAX_CACHE_ENTRIES", 50)
    good = [generate_key() for _ in range(10)]
    store = FakeStore(good)
    cache = KeyCache(store.lookup_hash, store.get_tenant, ttl_ms=60_000, clock=lambda: 0.0)

    async def run() -> None:
        for k in good:
            assert (await cache.authenticate(k)).key.tenant_id == "team"
        for _ in range(500):  # ten times the bound
            with pytest.raises(UnauthenticatedError, match="unknown API key"):
                await cache.authenticate(generate_key())
        for k in good:
            await cache.authenticate(k)

    asyncio.run(run())
    assert all(store.lookups[hash_key(k)] == 1 for k in good)  # served from the cache
    assert len(cache) <= 2 * 50


def test_the_least_recently_used_valid_key_goes_first(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(auth, "MAX_CACHE_ENTRIES", 3)
    keys = [generate_key() for _ in range(4)]
    store = FakeStore(keys)
    cache = KeyCache(store.lookup_hash, store.get_tenant, ttl_ms=60_000, clock=lambda: 0.0)

    async def run() -> None:
        for k in keys[:3]:
            await cache.authenticate(k)
        await cache.authenticate(keys[0])  # now the most recently used
        await cache.authenticate(keys[3])  # evicts keys[1]
        for k in (keys[0], keys[2], keys[3], keys[1]):
            await cache.authenticate(k)

    asyncio.run(run())
    assert [store.lookups[hash_key(k)] for k in keys] == [1, 2, 1, 1]


def test_a_cached_key_is_refused_the_moment_it_expires() -> None:
    key = generate_key()
    store = FakeStore([key])
    digest = hash_key(key)
    store.keys[digest] = dataclasses.replace(
        store.keys[digest], expires_at=1000.0, rotated_to="key_new"
    )
    now = [999.0]
    used: list[str] = []
    cache = KeyCache(
        store.lookup_hash,
        store.get_tenant,
        ttl_ms=60_000,
        clock=lambda: 0.0,
        wall=lambda: now[0],
        on_use=lambda k: used.append(k.key_id),
    )

    async def run() -> None:
        assert (await cache.authenticate(key)).key.key_id == "key_0"
        assert cache.known_valid(key)
        now[0] = 1000.0  # still cached, but expired now
        with pytest.raises(PermissionDeniedError, match=r"expired at .*replacement key_new"):
            await cache.authenticate(key)
        assert not cache.known_valid(key)

    asyncio.run(run())
    assert store.lookups[digest] == 1
    assert used == ["key_0"]  # only the successful use counts
