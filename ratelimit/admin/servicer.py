"""``llm.v1.RateLimitAdmin``: a thin servicer over the registry, limiter and audit log.

Every call must carry ``authorization: Bearer <ADMIN key>``; every mutation
is written to the audit log with the admin key's id as the actor. Errors map
once, in ``_run`` (see ``ratelimit.status.status_for``). The gateway mounts
this servicer in its own process; ``python -m ratelimit`` serves it alone.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc
from google.api import httpbody_pb2

from llm.v1 import admin_pb2, admin_pb2_grpc
from ratelimit import metrics
from ratelimit.admin import convert
from ratelimit.admin.calls import run_admin_call
from ratelimit.budget.ledger import BudgetLedger
from ratelimit.limiter.rate_limiter import RateLimiter
from ratelimit.tenancy.audit import AuditLog
from ratelimit.tenancy.records import budget_to_dict, tenant_to_json
from ratelimit.tenancy.registry import Registry
from ratelimit.usage.records import UsageLog, UsageRecord, to_csv, to_json

R = TypeVar("R")
Context = grpc.aio.ServicerContext[Any, Any]
SERVICE_NAME = admin_pb2.DESCRIPTOR.services_by_name["RateLimitAdmin"].full_name
MAX_AUDIT_EVENTS = 1000
DEFAULT_ROTATION_GRACE_S = 3600


class RateLimitAdminServicer(admin_pb2_grpc.RateLimitAdminServicer):
    """Admin API for tenants, keys, limits, usage and the audit log.

    Args:
        registry: Tenants and keys.
        limiter: For live usage and resets.
        audit: Where mutations are recorded.
        budgets: The budget ledger (budget spending in usage, resets, deletes).
        usage: The usage records (queries and exports).
    """

    def __init__(
        self,
        registry: Registry,
        limiter: RateLimiter,
        audit: AuditLog,
        budgets: BudgetLedger | None = None,
        usage: UsageLog | None = None,
    ) -> None:
        self.registry = registry
        self.limiter = limiter
        self.audit = audit
        self.budgets = budgets
        self.usage = usage

    async def _run(self, context: Context, method: str, fn: Callable[[str], Awaitable[R]]) -> R:
        """Authenticate the admin, run ``fn(actor_key_id)``, map errors to a status."""
        return await run_admin_call(
            self.registry, context, method, fn, counter=metrics.ADMIN_REQUESTS
        )

    async def UpsertTenant(self, request: admin_pb2.Tenant, context: Context) -> admin_pb2.Tenant:
        """Create or replace a tenant (limits, priority, models, shadow mode)."""

        async def run(actor: str) -> admin_pb2.Tenant:
            tenant = await self.registry.upsert_tenant(convert.tenant_from_proto(request))
            detail = json.loads(tenant_to_json(tenant))
            await self.audit.record(actor, "UpsertTenant", tenant.tenant_id, detail)
            return convert.tenant_to_proto(tenant)

        return await self._run(context, "UpsertTenant", run)

    async def UpdateTenant(
        self, request: admin_pb2.UpdateTenantRequest, context: Context
    ) -> admin_pb2.Tenant:
        """Change only the masked fields of an existing tenant (read, merge, write)."""

        async def run(actor: str) -> admin_pb2.Tenant:
            paths = convert.mask_paths(request.tenant, request.update_mask, convert.TENANT_MUTABLE)
            current = await self.registry.get_tenant(request.tenant.id)
            merged = convert.merge_tenant(current, request.tenant, paths)
            tenant = await self.registry.upsert_tenant(merged)
            detail = {"paths": paths, "tenant": json.loads(tenant_to_json(tenant))}
            await self.audit.record(actor, "UpdateTenant", tenant.tenant_id, detail)
            return convert.tenant_to_proto(tenant)

        return await self._run(context, "UpdateTenant", run)

    async def GetTenant(
        self, request: admin_pb2.GetTenantRequest, context: Context
    ) -> admin_pb2.Tenant:
        """One tenant."""

        async def run(actor: str) -> admin_pb2.Tenant:
            return convert.tenant_to_proto(await self.registry.get_tenant(request.tenant_id))

        return await self._run(context, "GetTenant", run)

    async def ListTenants(
        self, request: admin_pb2.ListTenantsRequest, context: Context
    ) -> admin_pb2.ListTenantsResponse:
        """Every tenant, sorted by id."""

        async def run(actor: str) -> admin_pb2.ListTenantsResponse:
            tenants = await self.registry.list_tenants()
            return admin_pb2.ListTenantsResponse(
                tenants=[convert.tenant_to_proto(t) for t in tenants]
            )

        return await self._run(context, "ListTenants", run)

    async def DeleteTenant(
        self, request: admin_pb2.DeleteTenantRequest, context: Context
    ) -> admin_pb2.DeleteTenantResponse:
        """Delete a tenant, revoke its keys, drop its buckets, leases, totals and budget
        spending."""

        async def run(actor: str) -> admin_pb2.DeleteTenantResponse:
            tenant = await self.registry.get_tenant(request.tenant_id)
            num_revoked = await self.registry.delete_tenant(request.tenant_id)
            await self.limiter.forget(request.tenant_id)
            if self.budgets is not None:
                await self.budgets.forget(tenant.tenant_id, tenant.budgets)
            detail = {"num_keys_revoked": num_revoked}
            await self.audit.record(actor, "DeleteTenant", request.tenant_id, detail)
            return admin_pb2.DeleteTenantResponse(num_keys_revoked=num_revoked)

        return await self._run(context, "DeleteTenant", run)

    async def CreateApiKey(
        self, request: admin_pb2.CreateApiKeyRequest, context: Context
    ) -> admin_pb2.CreateApiKeyResponse:
        """Issue a key; the plaintext is in this response only."""

        async def run(actor: str) -> admin_pb2.CreateApiKeyResponse:
            role = convert.key_role_from_proto(request.role)
            plaintext, key = await self.registry.create_key(
                request.tenant_id,
                request.name,
                role,
                owner=request.owner,
                description=request.description,
                expires_at=convert.seconds(request.expires_at),
                budgets=tuple(convert.budget_from_proto(b) for b in request.budgets),
            )
            detail = {
                "tenant_id": key.tenant_id,
                "name": key.name,
                "role": key.role.name,
                "display_prefix": key.display_prefix,
                "owner": key.owner,
                "expires_at": key.expires_at,
            }
            await self.audit.record(actor, "CreateApiKey", key.key_id, detail)
            return admin_pb2.CreateApiKeyResponse(key=plaintext, api_key=convert.key_to_proto(key))

        return await self._run(context, "CreateApiKey", run)

    async def RevokeApiKey(
        self, request: admin_pb2.RevokeApiKeyRequest, context: Context
    ) -> admin_pb2.RevokeApiKeyResponse:
        """Revoke a key; every replica refuses it within ``auth_cache_ttl_ms``."""

        async def run(actor: str) -> admin_pb2.RevokeApiKeyResponse:
            key = await self.registry.revoke_key(request.key_id)
            await self.audit.record(actor, "RevokeApiKey", key.key_id, {"tenant_id": key.tenant_id})
            return admin_pb2.RevokeApiKeyResponse(api_key=convert.key_to_proto(key))

        return await self._run(context, "RevokeApiKey", run)

    async def ListApiKeys(
        self, request: admin_pb2.ListApiKeysRequest, context: Context
    ) -> admin_pb2.ListApiKeysResponse:
        """Keys of a tenant (empty tenant_id: the ADMIN keys)."""

        async def run(actor: str) -> admin_pb2.ListApiKeysResponse:
            keys = await self.registry.list_keys(request.tenant_id)
            used = await self.registry.last_used([k.key_id for k in keys])
            return admin_pb2.ListApiKeysResponse(
                api_keys=[convert.key_to_proto(k, used.get(k.key_id, 0.0)) for k in keys]
            )

        return await self._run(context, "ListApiKeys", run)

    async def UpdateApiKey(
        self, request: admin_pb2.UpdateApiKeyRequest, context: Context
    ) -> admin_pb2.ApiKey:
        """Change a key's name, owner, description or expiry."""

        async def run(actor: str) -> admin_pb2.ApiKey:
            paths = convert.mask_paths(request.api_key, request.update_mask, convert.KEY_MUTABLE)
            changes = convert.key_changes(request.api_key, paths)
            key = await self.registry.update_key(request.api_key.key_id, changes)
            detail = {**changes, "budgets": [budget_to_dict(b) for b in key.budgets]}
            await self.audit.record(actor, "UpdateApiKey", key.key_id, detail)
            return convert.key_to_proto(key)

        return await self._run(context, "UpdateApiKey", run)

    async def RotateApiKey(
        self, request: admin_pb2.RotateApiKeyRequest, context: Context
    ) -> admin_pb2.RotateApiKeyResponse:
        """Issue a replacement key; the old one expires after the grace period."""

        async def run(actor: str) -> admin_pb2.RotateApiKeyResponse:
            grace = request.grace_seconds or DEFAULT_ROTATION_GRACE_S
            plaintext, new, old = await self.registry.rotate_key(request.key_id, grace)
            detail = {"new_key_id": new.key_id, "old_expires_at": old.expires_at}
            await self.audit.record(actor, "RotateApiKey", old.key_id, detail)
            return admin_pb2.RotateApiKeyResponse(
                key=plaintext, api_key=convert.key_to_proto(new), previous=convert.key_to_proto(old)
            )

        return await self._run(context, "RotateApiKey", run)

    async def GetUsage(
        self, request: admin_pb2.GetUsageRequest, context: Context
    ) -> admin_pb2.TenantUsage:
        """Live bucket levels (-1 = unlimited), leases in use, running totals and what
        each budget has counted in its current period."""

        async def run(actor: str) -> admin_pb2.TenantUsage:
            tenant = await self.registry.get_tenant(request.tenant_id)
            levels = None
            if self.budgets is not None:
                keys = await self.registry.list_keys(tenant.tenant_id)
                budgets = [*tenant.budgets, *(b for k in keys if not k.revoked for b in k.budgets)]
                levels = await self.budgets.levels(tenant.tenant_id, budgets) if budgets else None
            return convert.usage_to_proto(tenant, await self.limiter.usage(tenant), levels)

        return await self._run(context, "GetUsage", run)

    async def ResetLimits(
        self, request: admin_pb2.ResetLimitsRequest, context: Context
    ) -> admin_pb2.ResetLimitsResponse:
        """Refill every bucket of the tenant (leases are kept); with ``budgets``, also zero
        what its budgets counted in their current periods."""

        async def run(actor: str) -> admin_pb2.ResetLimitsResponse:
            tenant = await self.registry.get_tenant(request.tenant_id)
            await self.limiter.reset(tenant.tenant_id)
            if request.budgets and self.budgets is not None:
                await self.budgets.reset(tenant.tenant_id, tenant.budgets)
            detail = {"budgets": request.budgets}
            await self.audit.record(actor, "ResetLimits", tenant.tenant_id, detail)
            return admin_pb2.ResetLimitsResponse()

        return await self._run(context, "ResetLimits", run)

    async def ListAuditEvents(
        self, request: admin_pb2.ListAuditEventsRequest, context: Context
    ) -> admin_pb2.ListAuditEventsResponse:
        """Newest audit events first (limit 0 = 100, at most 1000)."""

        async def run(actor: str) -> admin_pb2.ListAuditEventsResponse:
            limit = min(request.limit or 100, MAX_AUDIT_EVENTS)
            events = await self.audit.list(limit)
            return admin_pb2.ListAuditEventsResponse(
                events=[convert.audit_to_proto(e) for e in events]
            )

        return await self._run(context, "ListAuditEvents", run)

    async def _records(self, request: admin_pb2.QueryUsageRequest) -> list[UsageRecord]:
        if self.usage is None:
            raise ValueError("this server keeps no usage records")
        return await self.usage.query(
            tenant_id=request.tenant_id,
            key_id=request.key_id,
            model=request.model,
            start=request.start_date,
            end=request.end_date,
        )

    async def QueryUsage(
        self, request: admin_pb2.QueryUsageRequest, context: Context
    ) -> admin_pb2.QueryUsageResponse:
        """Usage records in a day range, by tenant, key, model and version."""

        async def run(actor: str) -> admin_pb2.QueryUsageResponse:
            records = await self._records(request)
            return admin_pb2.QueryUsageResponse(
                records=[convert.usage_record_to_proto(r) for r in records]
            )

        return await self._run(context, "QueryUsage", run)

    async def ExportUsage(
        self, request: admin_pb2.QueryUsageRequest, context: Context
    ) -> httpbody_pb2.HttpBody:
        """The usage records as a CSV (default) or JSON file."""

        async def run(actor: str) -> httpbody_pb2.HttpBody:
            fmt = request.format.lower() or "csv"
            if fmt not in ("csv", "json"):
                raise ValueError(f"format must be csv or json, got {request.format!r}")
            records = await self._records(request)
            if fmt == "csv":
                return httpbody_pb2.HttpBody(
                    content_type="text/csv; charset=utf-8", data=to_csv(records).encode()
                )
            return httpbody_pb2.HttpBody(
                content_type="application/json", data=to_json(records).encode()
            )

        return await self._run(context, "ExportUsage", run)


def add_to_server(servicer: RateLimitAdminServicer, server: grpc.aio.Server) -> list[str]:
    """Mount the servicer; returns the full service name for health and reflection."""
    admin_pb2_grpc.add_RateLimitAdminServicer_to_server(servicer, server)
    return [SERVICE_NAME]
