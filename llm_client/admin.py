"""``llm-client admin``: the RateLimitAdmin and RoutingAdmin calls each sub-command makes.

A tenant command changes only the settings its flags give (the rest of an existing
tenant is kept); a key update sends an update mask of the flags given. Answers print
as JSON, an export (CSV or JSON) as it is.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import grpc
from google.api import httpbody_pb2
from google.protobuf import json_format
from google.protobuf.message import Message
from google.protobuf.timestamp_pb2 import Timestamp

from llm.v1 import admin_pb2, admin_pb2_grpc, common_pb2
from llm_client.transport import read_key


def update_tenant(t: admin_pb2.Tenant, a: argparse.Namespace) -> None:
    """Apply the flags that were given (None = not given) to ``t``."""
    limits = t.limits
    for flag, field in (
        ("rpm", "requests_per_minute"),
        ("tpm", "tokens_per_minute"),
        ("concurrent", "max_concurrent"),
        ("request_burst", "request_burst"),
        ("token_burst", "token_burst"),
    ):
        value = getattr(a, flag)
        if value is not None:
            setattr(limits, field, value)
    if a.priority is not None:
        t.priority = common_pb2.Priority.Value(a.priority)
    if a.share is not None:
        t.fair_share = a.share
    if a.cache_group is not None:
        t.prefix_cache_group = a.cache_group
    if a.all_models:
        del t.allowed_models[:]
    elif a.model:
        t.allowed_models[:] = a.model
    if a.shadow is not None:
        t.shadow_mode = a.shadow
    update_budgets(t, a)


def update_budgets(t: admin_pb2.Tenant, a: argparse.Namespace) -> None:
    """Replace or add the ``--budget`` budgets by name; drop the ``--drop-budget`` ones."""
    given = {b.name: b for b in a.budget or ()}
    drop = set(a.drop_budget or ())
    kept = [b for b in t.budgets if b.name not in given and b.name not in drop]
    del t.budgets[:]
    t.budgets.extend([*kept, *given.values()])


def _expiry(seconds_from_now: int | None) -> Timestamp | None:
    if seconds_from_now is None:
        return None
    ts = Timestamp()
    ts.FromSeconds(int(time.time()) + seconds_from_now)
    return ts


def key_update(a: argparse.Namespace) -> admin_pb2.UpdateApiKeyRequest:
    """UpdateApiKey for the flags given (others unchanged)."""
    req = admin_pb2.UpdateApiKeyRequest(api_key=admin_pb2.ApiKey(key_id=a.key_id))
    for name in ("name", "owner", "description"):
        value = getattr(a, name)
        if value is not None:
            setattr(req.api_key, name, value)
            req.update_mask.paths.append(name)
    if a.budget or a.no_budgets:  # the key's whole list of budgets is replaced
        req.api_key.budgets.extend(a.budget or ())
        req.update_mask.paths.append("budgets")
    if a.expires_in is not None or a.no_expiry:
        expiry = _expiry(a.expires_in)
        if expiry is not None:
            req.api_key.expires_at.CopyFrom(expiry)
        req.update_mask.paths.append("expires_at")
    if not req.update_mask.paths:
        raise SystemExit(
            "key-update: give at least one of --name, --owner, --description, "
            "--expires-in, --no-expiry, --budget, --no-budgets"
        )
    return req


def _admin_calls(a: argparse.Namespace) -> dict[str, Callable[[Any], Message]]:
    def tenant(stub: Any) -> Message:
        """Create, or change only what the flags say: the rest of an existing tenant
        (limits, priority, models, shadow mode) is kept, not reset."""
        try:
            t = stub.GetTenant(admin_pb2.GetTenantRequest(tenant_id=a.tenant))
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.NOT_FOUND:
                raise
            t = admin_pb2.Tenant(id=a.tenant, priority=common_pb2.Priority.Value("NORMAL"))
        update_tenant(t, a)
        resp: Message = stub.UpsertTenant(t)
        return resp

    return {
        "tenants": lambda s: s.ListTenants(admin_pb2.ListTenantsRequest()),
        "tenant": tenant,
        "get": lambda s: s.GetTenant(admin_pb2.GetTenantRequest(tenant_id=a.tenant)),
        "delete": lambda s: s.DeleteTenant(admin_pb2.DeleteTenantRequest(tenant_id=a.tenant)),
        "key": lambda s: s.CreateApiKey(
            admin_pb2.CreateApiKeyRequest(
                tenant_id=a.tenant,
                name=a.name,
                owner=a.owner or "",
                description=a.description or "",
                expires_at=_expiry(a.expires_in),
                budgets=a.budget or (),
            )
        ),
        "key-update": lambda s: s.UpdateApiKey(key_update(a)),
        "rotate": lambda s: s.RotateApiKey(
            admin_pb2.RotateApiKeyRequest(key_id=a.key_id, grace_seconds=a.grace)
        ),
        "keys": lambda s: s.ListApiKeys(admin_pb2.ListApiKeysRequest(tenant_id=a.tenant)),
        "revoke": lambda s: s.RevokeApiKey(admin_pb2.RevokeApiKeyRequest(key_id=a.key_id)),
        "usage": lambda s: s.GetUsage(admin_pb2.GetUsageRequest(tenant_id=a.tenant)),
        "reset": lambda s: s.ResetLimits(
            admin_pb2.ResetLimitsRequest(tenant_id=a.tenant, budgets=a.budgets)
        ),
        "audit": lambda s: s.ListAuditEvents(admin_pb2.ListAuditEventsRequest(limit=a.limit)),
        "models": lambda s: s.ListRoutingPolicies(admin_pb2.ListRoutingPoliciesRequest()),
        "routing": lambda s: s.GetRoutingPolicy(admin_pb2.GetRoutingPolicyRequest(model=a.model)),
        "rollout": lambda s: s.GetRolloutStatus(admin_pb2.GetRolloutStatusRequest(model=a.model)),
        "weights": lambda s: s.SetWeights(
            admin_pb2.SetWeightsRequest(
                model=a.model,
                weights=dict(a.weights),
                expected_revision=a.expect_revision,
                reason=a.reason,
            )
        ),
        "rollback": lambda s: s.Rollback(
            admin_pb2.RollbackRequest(
                model=a.model, to_version=a.to or "", reason=a.reason, keep_pins=a.keep_pins
            )
        ),
        "promote": lambda s: s.Promote(
            admin_pb2.PromoteRequest(model=a.model, version=a.version, reason=a.reason)
        ),
        "routes": lambda s: s.ListModelRoutes(admin_pb2.ListModelRoutesRequest()),
        "route": lambda s: s.SetModelRoute(
            admin_pb2.ModelRoute(
                name=a.name,
                targets=[
                    admin_pb2.RouteTarget(model=m, version=v)
                    for m, _, v in (t.partition("@") for t in a.targets)
                ],
                reason=a.reason,
            )
        ),
        "route-delete": lambda s: s.DeleteModelRoute(
            admin_pb2.DeleteModelRouteRequest(name=a.name)
        ),
        "usage-export": lambda s: s.ExportUsage(
            admin_pb2.QueryUsageRequest(
                tenant_id=a.tenant or "",
                key_id=a.key or "",
                model=a.model or "",
                start_date=a.start or "",
                end_date=a.end or "",
                format=a.format,
            )
        ),
    }


def admin(channel: grpc.Channel, args: argparse.Namespace) -> int:
    stubs = (
        admin_pb2_grpc.RateLimitAdminStub(channel),
        admin_pb2_grpc.RoutingAdminStub(channel),  # no method name in both services
    )
    md = (("authorization", f"Bearer {read_key(args.admin_key, 'ADMIN_KEY', 'admin.key')}"),)

    class WithMetadata:  # every call carries the admin key and the timeout
        def __getattr__(self, name: str) -> Callable[[Message], Message]:
            rpc = next(getattr(s, name) for s in stubs if hasattr(s, name))
            return lambda req: rpc(req, metadata=md, timeout=args.timeout)

    resp = _admin_calls(args)[args.admin_cmd](WithMetadata())
    if isinstance(resp, httpbody_pb2.HttpBody):  # a file: as it is
        sys.stdout.write(resp.data.decode())
        return 0
    print(json.dumps(json_format.MessageToDict(resp), indent=None if args.json else 2))
    return 0
