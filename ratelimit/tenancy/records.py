"""API keys and the JSON records the registry keeps in Redis.

A key is ``sk-llm-`` + 43 url-safe characters (256 random bits). Redis holds
only its SHA-256 (hex) and a short display prefix; the plaintext exists once,
in the ``CreateApiKey`` response. Lookups go by hash, so the stored secret is
never compared character by character with attacker input.
"""

from __future__ import annotations

import enum
import hashlib
import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from ratelimit.budget.policy import Budget, Metric, Period
from ratelimit.config import LimitPolicy, Priority, Tenant

KEY_PREFIX = "sk-llm-"
KEY_RE = re.compile(r"^sk-llm-[A-Za-z0-9_-]{20,128}$")
DISPLAY_PREFIX_LEN = len(KEY_PREFIX) + 4


class KeyRole(enum.IntEnum):
    """What a key may call; values match ``llm.v1.KeyRole`` (UNSPECIFIED = TENANT)."""

    UNSPECIFIED = 0
    TENANT = 1
    ADMIN = 2


@dataclass(frozen=True, slots=True)
class ApiKey:
    """The stored description of a key (never its plaintext)."""

    key_id: str
    tenant_id: str  # "" for ADMIN keys
    name: str
    display_prefix: str
    role: KeyRole
    key_hash: str
    revoked: bool = False
    created_at: float = 0.0  # unix seconds
    revoked_at: float = 0.0
    expires_at: float = 0.0  # 0 = never
    owner: str = ""  # who holds it (a person or a service), for audits
    description: str = ""
    rotated_to: str = ""  # key id of the key that replaced this one (RotateApiKey)
    budgets: tuple[Budget, ...] = ()  # the key's own, inside its tenant's (owner = spends_as)
    # the key whose budget counters this key's budgets count on ("" = its own): a rotated
    # key's replacement inherits its predecessor's spending (and so on down a chain)
    budget_owner: str = ""

    @property
    def spends_as(self) -> str:
        """The owner of this key's budget counters: its predecessor's, or its own id."""
        return self.budget_owner or self.key_id

    def expired(self, now: float) -> bool:
        """True once ``expires_at`` (if set) has passed."""
        return bool(self.expires_at) and now >= self.expires_at


@dataclass(frozen=True, slots=True)
class Principal:
    """Who a valid key belongs to; ``tenant`` is None for ADMIN keys."""

    key: ApiKey
    tenant: Tenant | None


MAX_KEY_TEXT = 256  # name, owner and description, each


def validate_key_text(**fields: str) -> None:
    """ValueError unless each field is at most ``MAX_KEY_TEXT`` printable characters."""
    for name, value in fields.items():
        if len(value) > MAX_KEY_TEXT or not value.isprintable():
            raise ValueError(
                f"key {name} must be at most {MAX_KEY_TEXT} printable characters (got {len(value)})"
            )


def generate_key() -> str:
    """A fresh plaintext key."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def new_key_id() -> str:
    """A public, loggable key id."""
    return "key_" + secrets.token_hex(8)


def hash_key(plaintext: str) -> str:
    """SHA-256 of the key, hex."""
    return hashlib.sha256(plaintext.encode()).hexdigest()


def looks_like_key(plaintext: str) -> bool:
    """Cheap format check before any Redis round trip."""
    return bool(KEY_RE.match(plaintext))


def key_to_json(key: ApiKey) -> str:
    """Serialize an ``ApiKey`` record."""
    return json.dumps(
        {
            "key_id": key.key_id,
            "tenant_id": key.tenant_id,
            "name": key.name,
            "display_prefix": key.display_prefix,
            "role": int(key.role),
            "key_hash": key.key_hash,
            "revoked": key.revoked,
            "created_at": key.created_at,
            "revoked_at": key.revoked_at,
            "expires_at": key.expires_at,
            "owner": key.owner,
            "description": key.description,
            "rotated_to": key.rotated_to,
            "budgets": [budget_to_dict(b) for b in key.budgets],
            **({"budget_owner": key.budget_owner} if key.budget_owner else {}),
        }
    )


def key_from_json(raw: str) -> ApiKey:
    """Parse an ``ApiKey`` record."""
    d: dict[str, Any] = json.loads(raw)
    return ApiKey(
        key_id=str(d["key_id"]),
        tenant_id=str(d["tenant_id"]),
        name=str(d["name"]),
        display_prefix=str(d["display_prefix"]),
        role=KeyRole(int(d["role"])),
        key_hash=str(d["key_hash"]),
        revoked=bool(d["revoked"]),
        created_at=float(d["created_at"]),
        revoked_at=float(d["revoked_at"]),
        expires_at=float(d.get("expires_at", 0.0)),
        owner=str(d.get("owner", "")),
        description=str(d.get("description", "")),
        rotated_to=str(d.get("rotated_to", "")),
        budgets=tuple(
            budget_from_dict(b, owner=str(d.get("budget_owner") or d["key_id"]))
            for b in d.get("budgets", ())
        ),
        budget_owner=str(d.get("budget_owner", "")),
    )


def tenant_to_json(tenant: Tenant) -> str:
    """Serialize a ``Tenant``."""
    limits = tenant.limits
    return json.dumps(
        {
            "tenant_id": tenant.tenant_id,
            "limits": {
                "requests_per_minute": limits.requests_per_minute,
                "tokens_per_minute": limits.tokens_per_minute,
                "max_concurrent": limits.max_concurrent,
                "request_burst": limits.request_burst,
                "token_burst": limits.token_burst,
            },
            "priority": int(tenant.priority),
            "allowed_models": list(tenant.allowed_models),
            "shadow_mode": tenant.shadow_mode,
            "display_name": tenant.display_name,
            "created_at": tenant.created_at,
            "updated_at": tenant.updated_at,
            "budgets": [budget_to_dict(b) for b in tenant.budgets],
            "fair_share": tenant.fair_share,
            "prefix_cache_group": tenant.prefix_cache_group,
        }
    )


def budget_to_dict(budget: Budget) -> dict[str, Any]:
    """A budget as plain JSON values."""
    return {
        "name": budget.name,
        "metric": budget.metric.name.lower(),
        "period": budget.period.name.lower(),
        "limit": budget.limit,
        "rolling": budget.rolling,
        "timezone": budget.timezone,
        "warn_percent": budget.warn_percent,
    }


def budget_from_dict(d: dict[str, Any], owner: str = "") -> Budget:
    """The inverse of ``budget_to_dict`` (``owner``: the key id of a key's budget)."""
    return Budget(
        owner=owner,
        name=str(d["name"]),
        metric=Metric[str(d["metric"]).upper()],
        period=Period[str(d["period"]).upper()],
        limit=d["limit"],
        rolling=bool(d.get("rolling", False)),
        timezone=str(d.get("timezone", "UTC")),
        warn_percent=int(d.get("warn_percent", 0)),
    )


def tenant_from_json(raw: str) -> Tenant:
    """Parse a ``Tenant``."""
    d: dict[str, Any] = json.loads(raw)
    return Tenant(
        tenant_id=str(d["tenant_id"]),
        limits=LimitPolicy(**{k: int(v) for k, v in d["limits"].items()}),
        priority=Priority(int(d["priority"])),
        allowed_models=tuple(str(m) for m in d["allowed_models"]),
        shadow_mode=bool(d["shadow_mode"]),
        display_name=str(d["display_name"]),
        created_at=float(d["created_at"]),
        updated_at=float(d["updated_at"]),
        budgets=tuple(budget_from_dict(b) for b in d.get("budgets", ())),
        fair_share=int(d.get("fair_share", 1)),  # records from before shares: 1
        prefix_cache_group=str(d.get("prefix_cache_group", "")),
    )
