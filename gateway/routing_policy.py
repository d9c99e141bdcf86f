"""The routing policy of one model: weights, pins, stickiness, shadow, guard (pure values).

    request ─► explicit model_version? ──yes──► that version, strictly
                    │ no
                    ▼
               tenant pinned? ──yes──► the pinned version (then the weighted ones)
                    │ no
                    ▼
               bucket = sticky key ? sha256(model, key) % 10000 : random
               ranges over the weighted versions, candidates first, stable last:

                   0 ────── canary (5%) ── 500 ─────────── stable (95%) ─── 10000

Putting the stable version last means raising a canary's weight only moves
sticky keys from stable to the canary, never between canaries' old and new
users. The policy is an immutable value; ``to_dict``/``from_dict`` are its
JSON form (in Redis and in the ``routing_policies`` config key).
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

NUM_BUCKETS = 10_000
STICKY_MODES = ("none", "session", "tenant")


@dataclass(frozen=True, slots=True)
class GuardPolicy:
    """When the guard rolls a candidate back (see ``gateway.release.canary_guard``)."""

    enabled: bool = False
    max_error_rate_increase: float = 0.05
    max_ttft_p95_ratio: float = 1.5
    min_requests: int = 20
    window_s: float = 300.0


@dataclass(frozen=True, slots=True)
class RoutingPolicy:
    """How the requests for one model are spread over its versions.

    Attributes:
        model: The model name.
        stable_version: Where a rollback sends all traffic.
        weights: Version -> relative weight (only versions with weight > 0 get traffic).
        tenant_pins: Tenant id -> version.
        sticky: ``none`` | ``session`` (x-session-id or user) | ``tenant``.
        shadow_version / shadow_percent: Mirror this share (0-100) of requests there.
        guard: Automatic rollback thresholds.
        revision: Bumped on every write (compare-and-set).
        updated_by / updated_at / last_rollback_reason: Bookkeeping for ops.
    """

    model: str
    stable_version: str
    weights: Mapping[str, int] = field(default_factory=dict)
    tenant_pins: Mapping[str, str] = field(default_factory=dict)
    sticky: str = "session"
    shadow_version: str = ""
    shadow_percent: float = 0.0
    guard: GuardPolicy = field(default_factory=GuardPolicy)
    revision: int = 0
    updated_by: str = ""
    updated_at: float = 0.0
    last_rollback_reason: str = ""

    def __post_init__(self) -> None:
        validate(self)

    def replace(self, **changes: Any) -> RoutingPolicy:
        """A copy with ``changes`` (validated again)."""
        return dataclasses.replace(self, **changes)

    def routed_versions(self) -> list[str]:
        """Versions with weight > 0: candidates by name, then the stable version last."""
        live = sorted(v for v, w in self.weights.items() if w > 0 and v != self.stable_version)
        if self.weights.get(self.stable_version, 0) > 0:
            live.append(self.stable_version)
        return live

    def percent(self, version: str) -> float:
        """Share of the weighted traffic ``version`` gets, in percent."""
        total = sum(self.weights.values())
        return 100.0 * self.weights.get(version, 0) / total if total else 0.0

    def state(self, version: str) -> str:
        """``stable`` | ``canary`` | ``shadow`` | ``draining`` (no new traffic)."""
        if version == self.stable_version and self.weights.get(version, 0) > 0:
            return "stable"
        if self.weights.get(version, 0) > 0:
            return "canary"
        if version == self.shadow_version and self.shadow_percent > 0:
            return "shadow"
        return "draining"

    def candidates(self) -> list[str]:
        """Versions under evaluation: weighted non-stable ones and the shadow target."""
        out = [v for v in self.routed_versions() if v != self.stable_version]
        if self.shadow_version and self.shadow_percent > 0 and self.shadow_version not in out:
            out.append(self.shadow_version)
        return out

    def to_dict(self) -> dict[str, Any]:
        """The JSON form."""
        d = dataclasses.asdict(self)
        d["weights"], d["tenant_pins"] = dict(self.weights), dict(self.tenant_pins)
        return d


def validate(p: RoutingPolicy) -> None:
    """Raise ``ValueError`` naming what is wrong with a policy."""
    where = f"routing policy of {p.model!r}"
    if not p.model:
        raise ValueError("routing policy: model is empty")
    if not p.stable_version:
        raise ValueError(f"{where}: stable_version is empty")
    if any(w < 0 for w in p.weights.values()) or sum(p.weights.values()) <= 0:
        raise ValueError(
            f"{where}: weights must be >= 0 with a positive sum, got {dict(p.weights)}"
        )
    if "" in p.weights or "" in p.tenant_pins.values():
        raise ValueError(f"{where}: a version name is empty")
    if p.sticky not in STICKY_MODES:
        raise ValueError(
            f"{where}: sticky must be one of {', '.join(STICKY_MODES)}, got {p.sticky!r}"
        )
    if not 0.0 <= p.shadow_percent <= 100.0:
        raise ValueError(f"{where}: shadow percent must be in [0, 100], got {p.shadow_percent}")
    g = p.guard
    if (
        g.max_error_rate_increase < 0
        or g.max_ttft_p95_ratio < 1.0
        or g.min_requests < 1
        or g.window_s <= 0
    ):
        raise ValueError(
            f"{where}: guard needs max_error_rate_increase >= 0, "
            "max_ttft_p95_ratio >= 1, min_requests >= 1 and window_s > 0"
        )


def from_dict(raw: Mapping[str, Any], model: str = "") -> RoutingPolicy:
    """A policy from its JSON/YAML form (``model`` fills a missing ``model`` key).

    Raises:
        ValueError: unknown keys or invalid values.
    """
    if not isinstance(raw, Mapping):
        raise ValueError(f"routing policy of {model!r}: expected a mapping, got {raw!r}")
    known = {f.name for f in dataclasses.fields(RoutingPolicy)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(
            f"routing policy of {model!r}: unknown key(s) {unknown}; valid: {sorted(known)}"
        )
    d = dict(raw)
    d.setdefault("model", model)
    guard = d.get("guard") or {}
    try:
        d["guard"] = GuardPolicy(**guard)
        d["weights"] = {str(k): int(v) for k, v in (d.get("weights") or {}).items()}
        d["tenant_pins"] = {str(k): str(v) for k, v in (d.get("tenant_pins") or {}).items()}
        return RoutingPolicy(**d)
    except TypeError as e:
        raise ValueError(f"routing policy of {model!r}: {e}") from None


def policies_from_config(raw: Mapping[str, Any]) -> dict[str, RoutingPolicy]:
    """The ``routing_policies`` config value (model -> policy mapping) as policies."""
    return {str(model): from_dict(body, str(model)) for model, body in raw.items()}


def bucket(model: str, key: str) -> int:
    """The sticky bucket of ``key`` for ``model``, in [0, NUM_BUCKETS)."""
    digest = hashlib.sha256(f"{model}\x00{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % NUM_BUCKETS


def pick_version(policy: RoutingPolicy, key: str | None, rng: random.Random) -> str:
    """The version for a sticky ``key`` (None = draw at random) by the policy's weights."""
    versions = policy.routed_versions()
    b = bucket(policy.model, key) if key is not None else rng.randrange(NUM_BUCKETS)
    total = sum(policy.weights[v] for v in versions)
    point = b * total / NUM_BUCKETS
    upto = 0.0
    for v in versions:
        upto += policy.weights[v]
        if point < upto:
            return v
    return versions[-1]
