"""Bearer key -> tenant, through the ratelimit registry (cached locally there).

This runs before any other work of a request: a caller without a valid
tenant key learns nothing else (not even whether its parameters are valid).
"""

from __future__ import annotations

import grpc

from common.interceptors import GateInterceptor
from gateway.domain import GatewayError
from ratelimit.config import Tenant
from ratelimit.errors import PermissionDeniedError, StoreError, UnauthenticatedError
from ratelimit.records import KeyRole
from ratelimit.registry import Registry

SCHEME = "bearer"


class ReflectionAuthInterceptor(GateInterceptor):
    """gRPC reflection describes the whole API: only callers with a valid key (a tenant's
    or an admin's) get it; anyone else gets UNAUTHENTICATED. Other methods pass through
    (they authenticate themselves)."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry

    async def refusal(self, details: grpc.HandlerCallDetails
                      ) -> tuple[grpc.StatusCode, str] | None:
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
            return (grpc.StatusCode.UNAUTHENTICATED,
                    "reflection needs a valid API key: send metadata "
                    "'authorization: Bearer sk-llm-...'")
        return None


def bearer_key(authorization: str) -> str:
    """The key of an ``authorization: Bearer <key>`` value.

    Raises:
        GatewayError: UNAUTHENTICATED when the value is missing or not a bearer token.
    """
    if not authorization:
        raise GatewayError(grpc.StatusCode.UNAUTHENTICATED,
                           "missing API key: send metadata 'authorization: Bearer sk-llm-...'")
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != SCHEME or not token.strip():
        raise GatewayError(grpc.StatusCode.UNAUTHENTICATED,
                           "the authorization metadata must be 'Bearer <API key>'")
    return token.strip()


class Authenticator:
    """Resolves a call's authorization to its tenant.

    Args:
        registry: The ratelimit registry (SHA-256 lookup with a short local cache).
    """

    def __init__(self, registry: Registry) -> None:
        self.registry = registry

    async def tenant(self, authorization: str) -> Tenant:
        """The tenant of a tenant-role key.

        Raises:
            GatewayError: UNAUTHENTICATED (no/unknown key), PERMISSION_DENIED
                (revoked key, deleted tenant, admin key), UNAVAILABLE (key store down).
        """
        key = bearer_key(authorization)
        try:
            principal = await self.registry.authenticate(key, KeyRole.TENANT)
        except UnauthenticatedError as e:
            raise GatewayError(grpc.StatusCode.UNAUTHENTICATED, str(e)) from None
        except PermissionDeniedError as e:
            raise GatewayError(grpc.StatusCode.PERMISSION_DENIED, str(e)) from None
        except StoreError as e:
            raise GatewayError(grpc.StatusCode.UNAVAILABLE,
                               f"cannot check the API key now: the key store is unavailable "
                               f"({e}); retry shortly") from None
        if principal.tenant is None:  # pragma: no cover - the registry checks the role
            raise GatewayError(grpc.StatusCode.PERMISSION_DENIED, "this key has no tenant")
        return principal.tenant

    @staticmethod
    def check_model(tenant: Tenant, model: str) -> None:
        """PERMISSION_DENIED unless the tenant may call ``model``."""
        if not tenant.allows_model(model):
            allowed = ", ".join(tenant.allowed_models)
            raise GatewayError(grpc.StatusCode.PERMISSION_DENIED,
                               f"tenant {tenant.tenant_id!r} may not use model {model!r}; "
                               f"allowed: {allowed}")
