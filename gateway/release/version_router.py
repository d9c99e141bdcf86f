"""Which version of a model serves a request, under the model's routing policy.

    decide(model, requested version, tenant, session key)
        requested version   -> that version only                 (reason "request")
        no policy           -> any version, by load              (reason "any")
        tenant pinned       -> the pin, then the weighted ones   (reason "pin")
        else                -> weighted pick (sticky key or random), then the
                               others: stable first, then by weight  (reason "weight")
        + a shadow version for ``shadow_percent`` of the requests

The fallbacks keep clients served when the chosen version has no replica
able to take the attempt (a canary down, its breaker open): the dispatcher
tries them in order. Such a request still counts as an error of the chosen
version, so the guard sees a canary that cannot serve. ``annotate`` adds the
weights and states of the policies to the pool's catalog (ListModels).
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

from gateway import metrics
from gateway.fleet.replica import Replica
from gateway.fleet.replica_pool import ModelEntry, ReplicaPool
from gateway.release.policy_store import PolicyCache
from gateway.release.version_stats import VersionStats
from gateway.routing_policy import RoutingPolicy, pick_version


@dataclass(frozen=True, slots=True)
class RouteDecision:
    """Where one admitted request goes."""

    version: str  # "" = any version
    fallbacks: tuple[str, ...] = ()
    reason: str = "any"
    shadow_version: str = ""  # "" = no shadow copy


def sticky_key(policy: RoutingPolicy, tenant_id: str, session_key: str) -> str | None:
    """The hash key of a request under the policy's sticky mode (None = draw at random)."""
    if policy.sticky == "tenant":
        return f"tenant:{tenant_id}"
    if policy.sticky == "session" and session_key:
        return f"session:{session_key}"
    return None


def fallback_order(policy: RoutingPolicy, chosen: str) -> tuple[str, ...]:
    """Weighted versions other than ``chosen``: stable first, then by weight."""
    others = [v for v in policy.routed_versions() if v != chosen]
    others.sort(key=lambda v: (v != policy.stable_version, -policy.weights[v], v))
    return tuple(others)


class VersionRouter:
    """Routing decisions by policy, and the attempt outcomes per version.

    Args:
        policies: Live policies (Redis, cached).
        pool: The engine replicas (to see whether a version can serve now).
        stats: Per-version outcomes for the guard.
        rng: Randomness for non-sticky picks and the shadow share (seed it in tests).
    """

    def __init__(
        self,
        policies: PolicyCache,
        pool: ReplicaPool,
        stats: VersionStats,
        rng: random.Random | None = None,
    ) -> None:
        self.policies = policies
        self.pool = pool
        self.stats = stats
        self.rng = rng or random.Random()

    async def decide(
        self, model: str, requested: str, tenant_id: str, session_key: str = ""
    ) -> RouteDecision:
        """The version (and fallbacks, shadow) for one admitted request."""
        if requested:
            decision = RouteDecision(requested, reason="request")
        else:
            policy = await self.policies.get(model)
            decision = (
                RouteDecision("")
                if policy is None
                else self._by_policy(policy, tenant_id, session_key)
            )
        metrics.ROUTING_DECISIONS.labels(model, decision.version, decision.reason).inc()
        if decision.reason in ("pin", "weight") and not self.pool.candidates(
            model, decision.version, ()
        ):
            self.stats.record(model, decision.version, ok=False)
            metrics.VERSION_ATTEMPTS.labels(model, decision.version, "unavailable").inc()
        return decision

    def _by_policy(self, policy: RoutingPolicy, tenant_id: str, session_key: str) -> RouteDecision:
        pin = policy.tenant_pins.get(tenant_id, "")
        if pin:
            version, reason = pin, "pin"
        else:
            key = sticky_key(policy, tenant_id, session_key)
            version, reason = pick_version(policy, key, self.rng), "weight"
        shadow = ""
        if (
            policy.shadow_version
            and policy.shadow_version != version
            and self.rng.random() * 100.0 < policy.shadow_percent
        ):
            shadow = policy.shadow_version
        return RouteDecision(version, fallback_order(policy, version), reason, shadow)

    def on_attempt(self, replica: Replica, verdict: bool | None, ttft_s: float | None) -> None:
        """Record an ended engine attempt (``Dispatcher.on_attempt``)."""
        if replica.info is None:
            return
        model, version = replica.info.model, replica.info.version
        outcome = {True: "ok", False: "error", None: "neutral"}[verdict]
        metrics.VERSION_ATTEMPTS.labels(model, version, outcome).inc()
        if verdict is not None:
            self.stats.record(model, version, ok=verdict, ttft_s=ttft_s)

    async def annotate(self, entries: list[ModelEntry]) -> list[ModelEntry]:
        """The catalog with each policy's weights and states (versions it names included)."""
        policies = await self.policies.all()
        out = []
        for e in entries:
            policy = policies.get(e.model)
            if policy is None:
                out.append(e)
                continue
            versions = dict(e.versions)
            for v in (*policy.weights, policy.shadow_version, *policy.tenant_pins.values()):
                if v:
                    versions.setdefault(v, (0, 0))
            routes = {v: (policy.percent(v), policy.state(v)) for v in versions}
            out.append(dataclasses.replace(e, versions=versions, routes=routes))
        return out
