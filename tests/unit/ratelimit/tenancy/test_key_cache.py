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


class SlowStore(FakeStore):
    """A FakeStore whose lookups read the record, then wait for ``gate``; can fail."""

    def __init__(self, valid: list[str]) -> None:
        super().__init__(valid)
        self.gate = asyncio.Event()
        self.gate.set()
        self.down = False

    async def lookup_hash(self, digest: str) -> ApiKey | None:
        self.lookups[digest] += 1
        record = self.keys.get(digest)  # as of the read's start
        await self.gate.wait()
        if self.down:
            raise ConnectionError("redis is down")
        return record


async def _authenticated_once() -> tuple[str, SlowStore, list[float], KeyCache]:
    """A key, its store, the cache's clock (ms; set now[0]) and a cache (TTL 1 s) that
    resolved the key once at time 0."""
    key = generate_key()
    store = SlowStore([key])
    now = [0.0]
    cache = KeyCache(store.lookup_hash, store.get_tenant, ttl_ms=1000, clock=lambda: now[0])
    await cache.authenticate(key)
    return key, store, now, cache


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_key_past_half_its_ttl_is_served_at_once_and_re_read_beside() -> None:
    key, store, now, cache = await _authenticated_once()
    now[0] = 400.0
    await cache.authenticate(key)
    await _settle()
    assert store.lookups[hash_key(key)] == 1  # young: no re-read
    # revoked on another replica: the re-read brings it in before the TTL
    digest = hash_key(key)
    store.keys[digest] = dataclasses.replace(store.keys[digest], revoked=True)
    store.gate.clear()  # the re-read hangs: the use does not wait for it
    now[0] = 600.0
    assert (await cache.authenticate(key)).key.key_id == "key_0"
    assert (await cache.authenticate(key)).key.key_id == "key_0"
    await _settle()
    assert store.lookups[hash_key(key)] == 2  # one re-read, not one per use
    store.gate.set()
    await _settle()
    now[0] = 700.0
    with pytest.raises(PermissionDeniedError, match="revoked"):
        await cache.authenticate(key)
    assert cache.num_refreshed_ahead == 1
    await cache.close()


async def test_a_failed_re_read_keeps_the_answer_until_its_ttl_only() -> None:
    key, store, now, cache = await _authenticated_once()
    store.down = True
    now[0] = 600.0
    await cache.authenticate(key)  # served; the re-read beside it fails
    await _settle()
    assert store.lookups[hash_key(key)] == 2
    now[0] = 1000.0  # past the TTL: the store is asked on the path, and is down
    with pytest.raises(ConnectionError):
        await cache.authenticate(key)
    await cache.close()


async def test_a_re_read_that_began_before_clear_is_dropped() -> None:
    key, store, now, cache = await _authenticated_once()
    store.gate.clear()
    now[0] = 600.0
    await cache.authenticate(key)  # a re-read starts and hangs with the old record
    await _settle()
    digest = hash_key(key)
    cache.clear()  # this replica revoked the key
    store.keys[digest] = dataclasses.replace(store.keys[digest], revoked=True)
    store.gate.set()
    await _settle()
    assert len(cache) == 0  # the stale answer was not put back
    with pytest.raises(PermissionDeniedError, match="revoked"):
        await cache.authenticate(key)
    await cache.close()
