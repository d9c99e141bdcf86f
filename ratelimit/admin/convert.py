"""Static converters between ``llm.v1`` admin messages and the domain types.

Validation happens in the domain constructors (``ValueError`` ->
INVALID_ARGUMENT); nothing here touches Redis.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import field_mask_pb2, timestamp_pb2
from google.protobuf.message import Message

from llm.v1 import admin_pb2
from ratelimit.budget.ledger import BudgetLevel
from ratelimit.budget.policy import Budget, Metric, Period
from ratelimit.config import LimitPolicy, Priority, Tenant
from ratelimit.limiter.storage import UsageSnapshot
from ratelimit.tenancy.audit import AuditEvent
from ratelimit.tenancy.records import ApiKey, KeyRole
from ratelimit.usage.records import UsageRecord


def _ts(seconds: float) -> timestamp_pb2.Timestamp | None:
    if not seconds:
        return None
    ts = timestamp_pb2.Timestamp()
    ts.FromNanoseconds(int(seconds * 1e9))
    return ts


def policy_from_proto(msg: admin_pb2.LimitPolicy) -> LimitPolicy:
    """Domain policy from its message (0 = unlimited)."""
    return LimitPolicy(
        requests_per_minute=msg.requests_per_minute,
        tokens_per_minute=msg.tokens_per_minute,
        max_concurrent=msg.max_concurrent,
        request_burst=msg.request_burst,
        token_burst=msg.token_burst,
    )


def policy_to_proto(policy: LimitPolicy) -> admin_pb2.LimitPolicy:
    """Message from a domain policy."""
    return admin_pb2.LimitPolicy(
        requests_per_minute=policy.requests_per_minute,
        tokens_per_minute=policy.tokens_per_minute,
        max_concurrent=policy.max_concurrent,
        request_burst=policy.request_burst,
        token_burst=policy.token_burst,
    )


def budget_from_proto(msg: admin_pb2.Budget, owner: str = "") -> Budget:
    """Domain budget (ValueError names what is wrong); ``owner``: a key's id."""
    if msg.period not in (p.value for p in Period):
        raise ValueError(
            f"budget {msg.name!r}: set period to BUDGET_HOUR, BUDGET_DAY or BUDGET_MONTH"
        )
    if msg.metric not in (0, *(m.value for m in Metric)):
        raise ValueError(f"budget {msg.name!r}: unknown metric {msg.metric}")
    return Budget(
        name=msg.name,
        metric=Metric(msg.metric or Metric.TOKENS),
        period=Period(msg.period),
        limit=msg.limit,
        rolling=msg.rolling,
        timezone=msg.timezone or "UTC",
        warn_percent=msg.warn_percent,
        owner=owner,
    )


def budget_to_proto(budget: Budget) -> admin_pb2.Budget:
    """Message from a domain budget."""
    return admin_pb2.Budget(
        name=budget.name,
        metric=int(budget.metric),  # type: ignore[arg-type]
        period=int(budget.period),  # type: ignore[arg-type]
        limit=float(budget.limit),
        rolling=budget.rolling,
        timezone=budget.timezone,
        warn_percent=budget.warn_percent,
    )


def budget_status_to_proto(level: BudgetLevel) -> admin_pb2.BudgetStatus:
    """A budget's spending in its current window."""
    return admin_pb2.BudgetStatus(
        budget=budget_to_proto(level.budget),
        used=level.used,
        remaining=max(0.0, level.budget.limit - level.used),
        resets_at=_ts(level.window.resets_at_ms / 1000),
        key_id=level.budget.owner,
    )


def tenant_from_proto(msg: admin_pb2.Tenant) -> Tenant:
    """Domain tenant from an UpsertTenant request (timestamps are ignored)."""
    priority = Priority(int(msg.priority))
    return Tenant(
        tenant_id=msg.id,
        limits=policy_from_proto(msg.limits),
        priority=Priority.NORMAL if priority == Priority.UNSPECIFIED else priority,
        allowed_models=tuple(msg.allowed_models),
        shadow_mode=msg.shadow_mode,
        display_name=msg.display_name,
        budgets=tuple(budget_from_proto(b) for b in msg.budgets),
        fair_share=msg.fair_share or 1,
        prefix_cache_group=msg.prefix_cache_group,
    )


def tenant_to_proto(tenant: Tenant) -> admin_pb2.Tenant:
    """Message from a domain tenant."""
    return admin_pb2.Tenant(
        id=tenant.tenant_id,
        limits=policy_to_proto(tenant.limits),
        priority=int(tenant.priority),  # type: ignore[arg-type]
        allowed_models=list(tenant.allowed_models),
        shadow_mode=tenant.shadow_mode,
        display_name=tenant.display_name,
        created_at=_ts(tenant.created_at),
        updated_at=_ts(tenant.updated_at),
        budgets=[budget_to_proto(b) for b in tenant.budgets],
        fair_share=tenant.fair_share,
        prefix_cache_group=tenant.prefix_cache_group,
    )


def key_role_from_proto(role: int) -> KeyRole:
    """Domain role (unknown values are an INVALID_ARGUMENT)."""
    try:
        return KeyRole(role)
    except ValueError:
        raise ValueError(f"unknown key role {role}; use TENANT or ADMIN") from None


def key_to_proto(key: ApiKey, last_used_at: float = 0.0) -> admin_pb2.ApiKey:
    """Message from a key record (never the plaintext, never the hash)."""
    return admin_pb2.ApiKey(
        key_id=key.key_id,
        tenant_id=key.tenant_id,
        name=key.name,
        display_prefix=key.display_prefix,
        role=int(key.role),  # type: ignore[arg-type]
        revoked=key.revoked,
        created_at=_ts(key.created_at),
        revoked_at=_ts(key.revoked_at),
        expires_at=_ts(key.expires_at),
        owner=key.owner,
        description=key.description,
        last_used_at=_ts(last_used_at),
        rotated_to=key.rotated_to,
        budgets=[budget_to_proto(b) for b in key.budgets],
    )


def seconds(ts: timestamp_pb2.Timestamp) -> float:
    """Unix seconds of a timestamp (0 when unset)."""
    return ts.ToNanoseconds() / 1e9


def mask_paths(
    patch: Message, mask: field_mask_pb2.FieldMask, mutable: tuple[str, ...]
) -> list[str]:
    """The paths an update changes: the mask's, or (empty mask) every field set in
    ``patch`` (message fields by their set subfields). ValueError names a path that is
    unknown or may not change (``mutable``: top-level fields that may)."""
    paths = list(mask.paths)
    if not paths:
        for field, value in patch.ListFields():
            if isinstance(value, Message) and not isinstance(value, timestamp_pb2.Timestamp):
                paths.extend(f"{field.name}.{f.name}" for f, _ in value.ListFields())
            else:
                paths.append(field.name)
        paths = [p for p in paths if p.split(".")[0] in mutable]
    check = field_mask_pb2.FieldMask(paths=paths)
    if not check.IsValidForDescriptor(patch.DESCRIPTOR):  # type: ignore[arg-type]
        raise ValueError(f"update_mask {paths} names a field that {patch.DESCRIPTOR.name} lacks")
    fixed = sorted({p.split(".")[0] for p in paths} - set(mutable))
    if fixed:
        raise ValueError(f"update_mask: {fixed} cannot change; changeable: {list(mutable)}")
    if not paths:
        raise ValueError("nothing to change: set update_mask or some fields")
    return paths


TENANT_MUTABLE = (
    "limits",
    "priority",
    "allowed_models",
    "shadow_mode",
    "display_name",
    "budgets",
    "fair_share",
    "prefix_cache_group",
)


def merge_tenant(current: Tenant, patch: admin_pb2.Tenant, paths: list[str]) -> Tenant:
    """``current`` with the ``paths`` of ``patch`` (lists and messages replaced whole
    when named whole)."""
    merged = tenant_to_proto(current)
    field_mask_pb2.FieldMask(paths=paths).MergeMessage(
        patch, merged, replace_message_field=True, replace_repeated_field=True
    )
    return tenant_from_proto(merged)


KEY_MUTABLE = ("name", "owner", "description", "expires_at", "budgets")


def key_changes(patch: admin_pb2.ApiKey, paths: list[str]) -> dict[str, Any]:
    """The registry's ``update_key`` changes for the masked fields of ``patch``."""
    out: dict[str, Any] = {}
    for path in paths:
        if path == "expires_at":
            out["expires_at"] = seconds(patch.expires_at)
        elif path == "budgets":
            out["budgets"] = tuple(budget_from_proto(b, patch.key_id) for b in patch.budgets)
        else:
            out[path] = getattr(patch, path)
    return out


def usage_to_proto(
    tenant: Tenant, usage: UsageSnapshot, budgets: list[BudgetLevel] | None = None
) -> admin_pb2.TenantUsage:
    """Live levels (-1 = unlimited), running totals and budget spending."""
    return admin_pb2.TenantUsage(
        tenant_id=tenant.tenant_id,
        requests_available=usage.requests_available,
        tokens_available=usage.tokens_available,
        concurrent_in_use=usage.concurrent_in_use,
        limits=policy_to_proto(tenant.limits),
        requests_total=usage.requests_total,
        prompt_tokens_total=usage.prompt_tokens_total,
        completion_tokens_total=usage.completion_tokens_total,
        requests_denied_total=usage.requests_denied_total,
        shadow_denials_total=usage.shadow_denials_total,
        budgets=[budget_status_to_proto(level) for level in budgets or ()],
    )


def audit_to_proto(event: AuditEvent) -> admin_pb2.AuditEvent:
    """Message from an audit event."""
    return admin_pb2.AuditEvent(
        time=_ts(event.time),
        actor=event.actor,
        action=event.action,
        target=event.target,
        detail=event.detail,
    )


def usage_record_to_proto(r: UsageRecord) -> admin_pb2.UsageRecord:
    """Message from a usage record."""
    return admin_pb2.UsageRecord(
        date=r.date,
        tenant_id=r.tenant_id,
        key_id=r.key_id,
        model=r.model,
        model_version=r.model_version,
        requests=r.requests,
        prompt_tokens=r.prompt_tokens,
        cached_prompt_tokens=r.cached_prompt_tokens,
        completion_tokens=r.completion_tokens,
        cost_usd=r.cost_usd,
        errors=r.errors,
    )
