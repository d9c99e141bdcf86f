"""Bearer key -> tenant, through the ratelimit registry (cached locally there).

This runs before any other work of a request: a caller without a valid
tenant key learns nothing else (not even whether its parameters are valid).
A key-cache miss reads Redis; when that read fails (a node down, a cluster
failing over, a connection closed under the call) the caller gets
UNAVAILABLE and is told to retry, never INTERNAL.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

import grpc

from common.interceptors import GateInterceptor
from gateway import metrics
from gateway.domain import CallContext, GatewayError
from ratelimit.config import Tenant
from ratelimit.errors import PermissionDeniedError, StoreError, UnauthenticatedError
from ratelimit.limiter.algorithm import refill, wait_ms
from ratelimit.redis_client import STORE_FAILURES, is_store_failure
from ratelimit.tenancy.bearer import bearer_credential
from ratelimit.tenancy.records import KeyRole, Principal, hash_key, looks_like_key
from ratelimit.tenancy.registry import Registry

_KEY_STORE_FAILURES: tuple[type[Exception], ...] = (StoreError, *STORE_FAILURES)


class ReflectionAuthInterceptor(GateInterceptor):
    """gRPC reflection describes the whole API: only callers with a valid key (a tenant's
    or an admin's) get it; anyone else gets UNAUTHENTICATED. Other methods pass through
    (they authenticate themselves)."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry

    async def refusal(self, details: grpc.HandlerCallDetails) -> tuple[grpc.StatusCode, str] | None:
        if not details.method.startswith("/grpc.reflection."):
            return None
        md = dict(details.invocation_metadata or ())
        try:
            key = bearer_key(str(md.get("authorization", "")))
            try:
                await self.registry.authenticate(key, KeyRole.TENANT)
            except PermissionDeniedError:  # an admin key: also fine here
                await self.registry.authenticate(key, KeyRole.ADMIN)
        except (GatewayError, UnauthenticatedError, PermissionDeniedError, StoreError):
            return (
                grpc.StatusCode.UNAUTHENTICATED,
                "reflection needs a valid API key: send metadata "
                "'authorization: Bearer sk-llm-...'",
            )
        return None


def bearer_key(authorization: str) -> str:
    """The key of an ``authorization: Bearer <key>`` value.

    Raises:
        GatewayError: UNAUTHENTICATED when the value is missing or not a bearer token.
    """
    try:
        return bearer_credential(authorization)
    except UnauthenticatedError as e:
        raise GatewayError(grpc.StatusCode.UNAUTHENTICATED, str(e)) from None


class FailedAuthThrottle:
    """Failed authentications per client address, as a token bucket per address.

    Each failure takes one unit from a bucket of ``burst`` that refills at
    ``per_minute``; an address whose bucket is empty is throttled until one unit
    is back. Successes refund nothing (one valid key must not launder a spray).
    At most ``max_sources`` addresses are tracked (least recently failing first
    out), so a spray from many addresses costs bounded memory.

    Throttling refuses by failed key, not by address alone: a throttled address's
    call with a key that already failed there (or none, or a malformed one) is
    refused without a lookup, but a key it has not tried is still checked, so a valid
    key behind the same address (a NAT) keeps working. Keys are 256 random bits, so
    the checks a spray still gets buy no guessing; each distinct key is looked up once
    per throttle period at most (``max_keys`` failed keys remembered per gateway).
    """

    def __init__(
        self,
        per_minute: int,
        burst: int,
        max_sources: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
        max_keys: int = 10_000,
    ) -> None:
        self.per_minute = per_minute
        self.burst = burst
        self.max_sources = max_sources
        self.max_keys = max_keys
        self.clock = clock
        self._sources: OrderedDict[str, tuple[float, float]] = OrderedDict()  # level, ms
        self._failed_keys: OrderedDict[tuple[str, str], None] = OrderedDict()  # source, sha

    def _level(self, source: str, now_ms: float) -> float:
        state = self._sources.get(source)
        if state is None:
            return float(self.burst)
        return refill(state[0], self.burst, self.per_minute, now_ms - state[1])

    def blocked_ms(self, source: str) -> int:
        """Milliseconds until ``source`` may fail again (0 = not throttled)."""
        if not self.per_minute or not source or source not in self._sources:
            return 0
        level = self._level(source, self.clock() * 1000)
        return 0 if level >= 1 else wait_ms(1 - level, self.per_minute)

    def failure(self, source: str, key: str = "") -> None:
        """Count one failed authentication of ``source`` (with ``key``, "" = none)."""
        if not self.per_minute or not source:
            return
        now_ms = self.clock() * 1000
        level = max(0.0, self._level(source, now_ms) - 1)
        self._sources[source] = (level, now_ms)
        self._sources.move_to_end(source)
        while len(self._sources) > self.max_sources:
            self._sources.popitem(last=False)
        if key:
            failed = (source, hash_key(key))
            self._failed_keys[failed] = None
            self._failed_keys.move_to_end(failed)
            while len(self._failed_keys) > self.max_keys:
                self._failed_keys.popitem(last=False)

    def refuses(self, source: str, key: str) -> int:
        """Milliseconds to refuse a call of ``source`` with ``key`` for without a lookup
        (0 = check the key): the address is throttled and the key is missing, malformed
        or one that already failed from there."""
        wait = self.blocked_ms(source)
        if not wait or (looks_like_key(key) and (source, hash_key(key)) not in self._failed_keys):
            return 0
        return wait


class Authenticator:
    """Resolves a call's authorization to its tenant.

    Args:
        registry: The ratelimit registry (SHA-256 lookup with a short local cache).
        throttle: Failed authentications per client address (None = unlimited).
    """

    def __init__(self, registry: Registry, throttle: FailedAuthThrottle | None = None) -> None:
        self.registry = registry
        self.throttle = throttle

    async def tenant(self, call: CallContext) -> Tenant:
        """The tenant of the call's tenant-role key.

        Raises:
            GatewayError: UNAUTHENTICATED (no/unknown key), PERMISSION_DENIED
                (revoked key, deleted tenant, admin key), UNAVAILABLE (key store down),
                RESOURCE_EXHAUSTED (too many failed authentications from this address,
                and the key is not one already known valid).
        """
        throttle = self.throttle
        key, throttled = "", False
        if throttle is not None:
            try:
                key = bearer_key(call.authorization)
            except GatewayError:
                key = ""
            if wait := throttle.refuses(call.source, key):
                raise self._throttled(call, wait)
            throttled = bool(throttle.blocked_ms(call.source))
        try:
            principal = await self._principal(call.authorization)
        except GatewayError as e:
            if throttle is not None and e.code in (
                grpc.StatusCode.UNAUTHENTICATED,
                grpc.StatusCode.PERMISSION_DENIED,
            ):
                throttle.failure(call.source, key)
                if throttled and (wait := throttle.blocked_ms(call.source)):
                    raise self._throttled(call, wait) from None  # a new key, checked: no
            raise
        call.key_id, call.key_budgets = principal.key.key_id, principal.key.budgets
        if principal.tenant is None:  # pragma: no cover - the registry checks the role
            raise GatewayError(grpc.StatusCode.PERMISSION_DENIED, "this key has no tenant")
        return principal.tenant

    @staticmethod
    def _throttled(call: CallContext, wait: int) -> GatewayError:
        metrics.AUTH_THROTTLED.inc()
        return GatewayError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"too many failed authentications from {call.source}; "
            f"retry after {wait} ms with a valid API key",
            retry_after_ms=wait,
        )

    async def _principal(self, authorization: str) -> Principal:
        key = bearer_key(authorization)
        try:
            principal = await self.registry.authenticate(key, KeyRole.TENANT)
        except UnauthenticatedError as e:
            raise GatewayError(grpc.StatusCode.UNAUTHENTICATED, str(e)) from None
        except PermissionDeniedError as e:
            raise GatewayError(grpc.StatusCode.PERMISSION_DENIED, str(e)) from None
        except _KEY_STORE_FAILURES as e:
            # the registry maps its Redis failures to StoreError; a client error that
            # still escapes it is the store's failure too (anything else is a bug)
            if not isinstance(e, StoreError) and not is_store_failure(e):
                raise
            raise GatewayError(
                grpc.StatusCode.UNAVAILABLE,
                f"cannot check the API key now: the key store is unavailable ({e}); retry shortly",
            ) from None
        return principal

    @staticmethod
    def check_model(tenant: Tenant, model: str) -> None:
        """PERMISSION_DENIED unless the tenant may call ``model``."""
        if not tenant.allows_model(model):
            allowed = ", ".join(tenant.allowed_models)
            raise GatewayError(
                grpc.StatusCode.PERMISSION_DENIED,
                f"tenant {tenant.tenant_id!r} may not use model {model!r}; allowed: {allowed}",
            )
