"""API key authentication with a short local cache.

Every answer (a principal, or a failure) is reused for at most
``auth_cache_ttl_ms`` (failures for at most 1 s, so a new key works almost at
once). That TTL is the bound on how long another gateway replica still
honours a revoked key or an old policy; the replica that makes a change
clears its own cache immediately. The hot path is one dict lookup: once a
valid key's answer is half the TTL old, its next use is served from the cache
and re-reads the key beside it (refresh-ahead), so a key in steady use never
waits for the store; only an answer past the TTL is re-read on the path.

Both caches are bounded LRUs, and failures live in their own: a caller
spraying made-up keys only evicts other failures, never the valid keys.
"""

from __future__ import annotations

import functools
import hmac
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from common.log import get_logger
from common.tasks import BackgroundOnce
from ratelimit import metrics
from ratelimit.config import Tenant
from ratelimit.errors import NotFoundError, PermissionDeniedError, UnauthenticatedError
from ratelimit.tenancy.records import ApiKey, KeyRole, Principal, hash_key, looks_like_key

log = get_logger(__name__)

NEGATIVE_CACHE_MS = 1000.0
MAX_CACHE_ENTRIES = 10_000


@dataclass(frozen=True, slots=True)
class AuthFailure:
    """A cached negative answer: the metric label and the error to raise."""

    result: str  # unknown | revoked
    message: str

    def error(self) -> Exception:
        """A fresh exception for this failure."""
        if self.result == "unknown":
            return UnauthenticatedError(self.message)
        return PermissionDeniedError(self.message)


class KeyCache:
    """Resolves plaintext keys through a TTL cache in front of the registry.

    Args:
        lookup_hash: Key record by SHA-256 (the registry's ``lookup_hash``).
        get_tenant: Tenant by id, raising ``NotFoundError``.
        ttl_ms: How long a positive answer is reused.
        clock: Monotonic milliseconds.
        wall: Unix seconds (key expiry is checked on every use, cached or not).
        on_use: Called with each key that authenticated (last-used bookkeeping).
    """

    def __init__(
        self,
        lookup_hash: Callable[[str], Awaitable[ApiKey | None]],
        get_tenant: Callable[[str], Awaitable[Tenant]],
        ttl_ms: float,
        clock: Callable[[], float] | None = None,
        wall: Callable[[], float] = time.time,
        on_use: Callable[[ApiKey], None] | None = None,
    ) -> None:
        self.lookup_hash = lookup_hash
        self.get_tenant = get_tenant
        self.ttl_ms = ttl_ms
        self.clock = clock or (lambda: time.monotonic() * 1000.0)
        self.wall = wall
        self.on_use = on_use
        self._good: OrderedDict[str, tuple[float, Principal]] = OrderedDict()
        self._bad: OrderedDict[str, tuple[float, AuthFailure]] = OrderedDict()
        self._ahead = BackgroundOnce[str]("auth refresh")  # re-reads in flight, by digest
        self.num_refreshed_ahead = 0
        self._generation = 0  # bumped by clear()

    def clear(self) -> None:
        """Forget every cached answer (after a local mutation); a re-read in flight
        began before it, so its answer is dropped."""
        self._good.clear()
        self._bad.clear()
        self._generation += 1

    def __len__(self) -> int:
        return len(self._good) + len(self._bad)

    def known_valid(self, plaintext: str) -> bool:
        """True when ``plaintext`` is a key this cache resolved to a principal recently
        (no store call): lets a throttled address keep using keys known to be good."""
        if not plaintext or not looks_like_key(plaintext):
            return False
        hit = self._good.get(hash_key(plaintext))
        return hit is not None and hit[0] > self.clock() and not hit[1].key.expired(self.wall())

    def _cached(self, digest: str, now: float) -> Principal | AuthFailure | None:
        """The live answer for ``digest``; a valid key's past half its TTL is re-read
        beside this use (refresh-ahead)."""
        hit = self._good.get(digest)
        if hit is not None and hit[0] > now:
            self._good.move_to_end(digest)
            if hit[0] - now <= self.ttl_ms / 2:
                self._ahead.start(digest, functools.partial(self._refresh_ahead, digest))
            return hit[1]
        miss = self._bad.get(digest)
        if miss is not None and miss[0] > now:
            self._bad.move_to_end(digest)
            return miss[1]
        return None

    def _store(self, digest: str, now: float, answer: Principal | AuthFailure) -> None:
        self._good.pop(digest, None)
        self._bad.pop(digest, None)
        if isinstance(answer, AuthFailure):
            self._bad[digest] = (now + min(self.ttl_ms, NEGATIVE_CACHE_MS), answer)
            cache: OrderedDict[str, Any] = self._bad
        else:
            self._good[digest] = (now + self.ttl_ms, answer)
            cache = self._good
        while len(cache) > MAX_CACHE_ENTRIES:
            cache.popitem(last=False)  # the least recently used

    async def authenticate(self, plaintext: str, role: KeyRole = KeyRole.TENANT) -> Principal:
        """See ``Registry.authenticate``."""
        if not plaintext or not looks_like_key(plaintext):
            metrics.AUTH_RESULTS.labels("malformed").inc()
            raise UnauthenticatedError(
                "missing or malformed API key: send metadata 'authorization: Bearer sk-llm-...'"
            )
        digest = hash_key(plaintext)
        now = self.clock()
        answer = self._cached(digest, now)
        if answer is None:
            answer = await self._resolve(digest)
            self._store(digest, now, answer)
        if isinstance(answer, AuthFailure):
            metrics.AUTH_RESULTS.labels(answer.result).inc()
            raise answer.error()
        key = answer.key
        if key.expired(self.wall()):  # checked on every use: a cached key expires on time
            metrics.AUTH_RESULTS.labels("expired").inc()
            when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(key.expires_at))
            hint = f"; use its replacement {key.rotated_to}" if key.rotated_to else ""
            raise PermissionDeniedError(
                f"API key {key.key_id} ({key.display_prefix}...) expired at {when}{hint}"
            )
        principal = _check_role(answer, role)
        if self.on_use is not None:
            self.on_use(key)
        return principal

    async def _refresh_ahead(self, digest: str) -> None:
        started = self.clock()  # the new answer is as old as the read's start
        generation = self._generation
        try:
            answer = await self._resolve(digest)
        except Exception as e:  # the store is down: the cached answer lives out its TTL
            log.warning("cannot re-read an API key ahead of its TTL", error=str(e))
        else:
            self.num_refreshed_ahead += 1
            if generation == self._generation:  # not cleared meanwhile
                self._store(digest, started, answer)

    async def close(self) -> None:
        """Stop the re-reads in flight (at shutdown)."""
        await self._ahead.close()

    async def _resolve(self, digest: str) -> Principal | AuthFailure:
        key = await self.lookup_hash(digest)
        if key is None or not hmac.compare_digest(key.key_hash, digest):
            return AuthFailure("unknown", "unknown API key; ask an admin for a key")
        if key.revoked:
            return AuthFailure(
                "revoked", f"API key {key.key_id} ({key.display_prefix}...) was revoked"
            )
        if key.role == KeyRole.ADMIN:
            return Principal(key, None)
        try:
            tenant = await self.get_tenant(key.tenant_id)
        except NotFoundError:
            return AuthFailure(
                "revoked", f"tenant {key.tenant_id!r} of API key {key.key_id} was deleted"
            )
        return Principal(key, tenant)


def _check_role(principal: Principal, role: KeyRole) -> Principal:
    have = principal.key.role
    if role == KeyRole.ADMIN and have != KeyRole.ADMIN:
        metrics.AUTH_RESULTS.labels("wrong_role").inc()
        raise PermissionDeniedError(
            f"API key {principal.key.key_id} is a tenant key; RateLimitAdmin needs an ADMIN key"
        )
    if role != KeyRole.ADMIN and have == KeyRole.ADMIN:
        metrics.AUTH_RESULTS.labels("wrong_role").inc()
        raise PermissionDeniedError(
            f"API key {principal.key.key_id} is an ADMIN key; use a tenant key for inference"
        )
    metrics.AUTH_RESULTS.labels("ok").inc()
    return principal
