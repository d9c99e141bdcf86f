"""Rollout operations on routing policies: set, shift weights, roll back, promote, delete.

The RoutingAdmin servicer and the canary guard both come here, so every
change goes through one path:

    read the stored policy fresh ─► check expected_revision ─► build the new value
        ─► compare-and-set in Redis (revision + 1) ─► this replica's cache at once
        ─► audit log (actor, action, model, reason, new policy) ─► weight gauges

Requests admitted before a change keep the version they were routed to (their
streams finish there); requests admitted after it follow the new policy on
this replica at once and on the others within the policy cache's TTL.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from common.log import get_logger
from gateway import metrics
from gateway.release.policy_store import PolicyCache
from gateway.routing_policy import RoutingPolicy
from ratelimit.errors import ConflictError, NotFoundError
from ratelimit.tenancy.audit import AuditLog

log = get_logger(__name__)
GUARD_ACTOR = "canary-guard"


class RolloutManager:
    """Mutations and reads of the routing policies.

    Args:
        policies: The shared policy cache (Redis behind it).
        audit: The admin audit log (shared with RateLimitAdmin); None = log only.
    """

    def __init__(self, policies: PolicyCache, audit: AuditLog | None) -> None:
        self.policies = policies
        self.audit = audit

    async def current(self, model: str) -> RoutingPolicy | None:
        """The stored policy, read through to the store (not the cache)."""
        self.policies.invalidate()
        return await self.policies.get(model)

    async def get(self, model: str) -> RoutingPolicy:
        """The stored policy of ``model``; ``NotFoundError`` when it has none."""
        policy = await self.current(model)
        if policy is None:
            raise NotFoundError(
                f"model {model!r} has no routing policy (every version "
                "serves by load); set one with SetRoutingPolicy"
            )
        return policy

    async def list(self) -> list[RoutingPolicy]:
        """Every policy, by model name."""
        self.policies.invalidate()
        return sorted((await self.policies.all()).values(), key=lambda p: p.model)

    async def set(
        self, policy: RoutingPolicy, *, expected: int, actor: str, reason: str
    ) -> RoutingPolicy:
        """Create or replace a policy (``expected`` > 0: only over that revision)."""
        old = await self.current(policy.model)
        return await self._write(old, policy, expected, actor, "SetRoutingPolicy", reason)

    async def set_weights(
        self, model: str, weights: Mapping[str, int], *, expected: int, actor: str, reason: str
    ) -> RoutingPolicy:
        """Replace only the weights (shift traffic)."""
        old = await self.get(model)
        return await self._write(
            old, old.replace(weights=dict(weights)), expected, actor, "SetWeights", reason
        )

    async def rollback(
        self,
        model: str,
        *,
        to_version: str = "",
        reason: str = "",
        keep_pins: bool = False,
        actor: str,
        expected: int = 0,
    ) -> RoutingPolicy:
        """All weight to ``to_version`` (default: the stable one), shadow off, pins cleared."""
        old = await self.get(model)
        target = to_version or old.stable_version
        dropped = set(old.candidates()) - {target}
        pins = {t: v for t, v in old.tenant_pins.items() if keep_pins or v not in dropped}
        new = old.replace(
            stable_version=target,
            weights={target: 100},
            tenant_pins=pins,
            shadow_version="",
            shadow_percent=0.0,
            last_rollback_reason=reason or f"manual rollback by {actor}",
        )
        trigger = "guard" if actor == GUARD_ACTOR else "manual"
        out = await self._write(
            old, new, expected, actor, "AutoRollback" if trigger == "guard" else "Rollback", reason
        )
        metrics.ROLLBACKS.labels(model, trigger).inc()
        log.warning(
            "routing policy rolled back",
            model=model,
            to_version=target,
            reason=reason,
            actor=actor,
            candidates=sorted(dropped),
        )
        return out

    async def promote(self, model: str, version: str, *, actor: str, reason: str) -> RoutingPolicy:
        """``version`` becomes stable with all the weight."""
        if not version:
            raise ValueError("Promote needs the version to promote")
        old = await self.get(model)
        shadow = old.shadow_version if old.shadow_version != version else ""
        new = old.replace(
            stable_version=version,
            weights={version: 100},
            shadow_version=shadow,
            shadow_percent=old.shadow_percent if shadow else 0.0,
        )
        return await self._write(old, new, 0, actor, "Promote", reason)

    async def delete(self, model: str, *, actor: str, reason: str) -> bool:
        """Drop the policy (every version then serves by load); False if there was none."""
        old = await self.current(model)
        if old is None:
            return False
        await self.policies.write(model, None, old.revision)
        await self._audit(actor, "DeleteRoutingPolicy", model, {"reason": reason})
        self._gauges(old, None)
        return True

    async def auto_rollback(self, policy: RoutingPolicy, why: str) -> RoutingPolicy:
        """The guard's rollback, only over the revision it judged."""
        return await self.rollback(
            policy.model, reason=f"automatic: {why}", actor=GUARD_ACTOR, expected=policy.revision
        )

    async def _write(
        self,
        old: RoutingPolicy | None,
        new: RoutingPolicy,
        expected: int,
        actor: str,
        action: str,
        reason: str,
    ) -> RoutingPolicy:
        revision = old.revision if old is not None else 0
        if expected and expected != revision:
            raise ConflictError(
                f"the routing policy of {new.model!r} is at revision "
                f"{revision}, not {expected}; read it again and retry"
            )
        new = new.replace(revision=revision + 1, updated_by=actor, updated_at=time.time())
        await self.policies.write(new.model, new, revision)
        await self._audit(actor, action, new.model, {"reason": reason, "policy": new.to_dict()})
        self._gauges(old, new)
        log.info(
            "routing policy changed",
            model=new.model,
            action=action,
            actor=actor,
            revision=new.revision,
            weights=dict(new.weights),
            reason=reason,
        )
        return new

    async def _audit(self, actor: str, action: str, model: str, detail: dict[str, Any]) -> None:
        if self.audit is not None:
            await self.audit.record(actor, action, f"model:{model}", detail)

    @staticmethod
    def _gauges(old: RoutingPolicy | None, new: RoutingPolicy | None) -> None:
        versions = set(old.weights if old else ()) | set(new.weights if new else ())
        some = new or old
        model = some.model if some is not None else ""
        for v in versions:
            metrics.POLICY_WEIGHT.labels(model, v).set(new.percent(v) if new else 0.0)
