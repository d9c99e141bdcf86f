"""``llm.v1.RoutingAdmin``: model versions, canaries, rollback and model routes (a thin
servicer).

Every call needs ``authorization: Bearer <ADMIN key>`` (the RateLimitAdmin
keys); every mutation goes through ``gateway.release.rollout.RolloutManager`` (routing
policies) or ``gateway.release.model_routes.RouteManager`` (model routes), which write
the audit log. Errors map once, in ``_run``: bad policy or route ->
INVALID_ARGUMENT, no policy -> NOT_FOUND, stale ``expected_revision`` ->
ABORTED (read again, retry), Redis down -> UNAVAILABLE.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc

from common.log import get_logger
from gateway.fleet.replica_pool import ReplicaPool
from gateway.release.model_routes import ModelRoute, RouteManager, RouteTarget
from gateway.release.rollout import RolloutManager
from gateway.release.version_stats import VersionStats
from gateway.routing_policy import GuardPolicy, RoutingPolicy
from llm.v1 import admin_pb2, admin_pb2_grpc
from ratelimit.admin.calls import run_admin_call
from ratelimit.tenancy.registry import Registry

log = get_logger(__name__)
R = TypeVar("R")
Context = grpc.aio.ServicerContext[Any, Any]
SERVICE_NAME = admin_pb2.DESCRIPTOR.services_by_name["RoutingAdmin"].full_name
_STICKY = {
    admin_pb2.STICKY_NONE: "none",
    admin_pb2.STICKY_SESSION: "session",
    admin_pb2.STICKY_TENANT: "tenant",
    admin_pb2.STICKY_MODE_UNSPECIFIED: "session",
}
_STICKY_BACK = {
    "none": admin_pb2.STICKY_NONE,
    "session": admin_pb2.STICKY_SESSION,
    "tenant": admin_pb2.STICKY_TENANT,
}


def policy_from_proto(msg: admin_pb2.RoutingPolicy) -> RoutingPolicy:
    """A policy from the admin message (0 in guard fields = the default); ValueError if bad."""
    default = GuardPolicy()
    g = msg.guard
    guard = GuardPolicy(
        enabled=g.enabled,
        max_error_rate_increase=g.max_error_rate_increase or default.max_error_rate_increase,
        max_ttft_p95_ratio=g.max_ttft_p95_ratio or default.max_ttft_p95_ratio,
        min_requests=g.min_requests or default.min_requests,
        window_s=float(g.window_s or default.window_s),
    )
    return RoutingPolicy(
        model=msg.model,
        stable_version=msg.stable_version,
        weights=dict(msg.weights),
        tenant_pins=dict(msg.tenant_pins),
        sticky=_STICKY.get(msg.sticky, "session"),
        shadow_version=msg.shadow.version,
        shadow_percent=msg.shadow.percent,
        guard=guard,
    )


def policy_to_proto(p: RoutingPolicy) -> admin_pb2.RoutingPolicy:
    """The admin message of a stored policy."""
    g = p.guard
    msg = admin_pb2.RoutingPolicy(
        model=p.model,
        stable_version=p.stable_version,
        weights=dict(p.weights),
        tenant_pins=dict(p.tenant_pins),
        sticky=_STICKY_BACK[p.sticky],
        shadow=admin_pb2.ShadowPolicy(version=p.shadow_version, percent=p.shadow_percent),
        guard=admin_pb2.CanaryGuard(
            enabled=g.enabled,
            max_error_rate_increase=g.max_error_rate_increase,
            max_ttft_p95_ratio=g.max_ttft_p95_ratio,
            min_requests=g.min_requests,
            window_s=int(g.window_s),
        ),
        revision=p.revision,
        updated_by=p.updated_by,
        last_rollback_reason=p.last_rollback_reason,
    )
    msg.updated_at.FromNanoseconds(int(p.updated_at * 1e9))
    return msg


def status_to_proto(
    p: RoutingPolicy, pool: ReplicaPool, stats: VersionStats, verdict: str | None
) -> admin_pb2.RolloutStatus:
    """The policy with this replica's per-version numbers over the guard window."""
    groups = pool.deployments()
    names = {v for (m, v) in groups if m == p.model} | set(p.weights)
    if p.shadow_version:
        names.add(p.shadow_version)
    versions = []
    for v in sorted(names):
        replicas = groups.get((p.model, v), [])
        s = stats.summary(p.model, v, p.guard.window_s, p.updated_at)
        versions.append(
            admin_pb2.VersionStatus(
                version=v,
                weight_percent=round(p.percent(v)),
                state=p.state(v),
                num_replicas=len(replicas),
                num_healthy_replicas=sum(1 for r in replicas if r.healthy and not r.draining),
                num_requests=s.num_requests,
                num_errors=s.num_errors,
                error_rate=s.error_rate,
                ttft_p95_s=s.ttft_p95_s or 0.0,
            )
        )
    return admin_pb2.RolloutStatus(
        policy=policy_to_proto(p), versions=versions, guard_verdict=verdict or ""
    )


class RoutingAdminServicer(admin_pb2_grpc.RoutingAdminServicer):
    """Admin API of the routing policies.

    Args:
        registry: For admin-key authentication.
        rollout: The policy operations (audited).
        pool: The engine replicas (replica counts per version).
        stats: This replica's per-version outcomes.
        judge: The guard's verdict for a policy (``gateway.release.canary_guard.judge``).
        routes: Audited changes to the model routes (aliases, fallback chains).
    """

    def __init__(
        self,
        registry: Registry,
        rollout: RolloutManager,
        pool: ReplicaPool,
        stats: VersionStats,
        judge: Callable[[RoutingPolicy, VersionStats], str | None],
        routes: RouteManager,
    ) -> None:
        self.registry = registry
        self.rollout = rollout
        self.pool = pool
        self.stats = stats
        self.judge = judge
        self.routes = routes

    async def _run(self, context: Context, method: str, fn: Callable[[str], Awaitable[R]]) -> R:
        """Authenticate the admin, run ``fn(actor_key_id)``, map errors to a status
        (a lost compare-and-set is ABORTED)."""
        return await run_admin_call(self.registry, context, method, fn)

    async def ListRoutingPolicies(
        self, request: admin_pb2.ListRoutingPoliciesRequest, context: Context
    ) -> admin_pb2.ListRoutingPoliciesResponse:
        """Every model's policy."""

        async def run(actor: str) -> admin_pb2.ListRoutingPoliciesResponse:
            policies = await self.rollout.list()
            return admin_pb2.ListRoutingPoliciesResponse(
                policies=[policy_to_proto(p) for p in policies]
            )

        return await self._run(context, "ListRoutingPolicies", run)

    async def GetRoutingPolicy(
        self, request: admin_pb2.GetRoutingPolicyRequest, context: Context
    ) -> admin_pb2.RoutingPolicy:
        """One model's policy (NOT_FOUND without one)."""

        async def run(actor: str) -> admin_pb2.RoutingPolicy:
            return policy_to_proto(await self.rollout.get(request.model))

        return await self._run(context, "GetRoutingPolicy", run)

    async def SetRoutingPolicy(
        self, request: admin_pb2.RoutingPolicy, context: Context
    ) -> admin_pb2.RoutingPolicy:
        """Create or replace a policy (compare-and-set with ``expected_revision``)."""

        async def run(actor: str) -> admin_pb2.RoutingPolicy:
            policy = await self.rollout.set(
                policy_from_proto(request),
                actor=actor,
                expected=request.expected_revision,
                reason=request.reason,
            )
            return policy_to_proto(policy)

        return await self._run(context, "SetRoutingPolicy", run)

    async def DeleteRoutingPolicy(
        self, request: admin_pb2.DeleteRoutingPolicyRequest, context: Context
    ) -> admin_pb2.DeleteRoutingPolicyResponse:
        """Drop a policy: every version of the model then serves by load."""

        async def run(actor: str) -> admin_pb2.DeleteRoutingPolicyResponse:
            deleted = await self.rollout.delete(request.model, actor=actor, reason="")
            return admin_pb2.DeleteRoutingPolicyResponse(deleted=deleted)

        return await self._run(context, "DeleteRoutingPolicy", run)

    async def SetWeights(
        self, request: admin_pb2.SetWeightsRequest, context: Context
    ) -> admin_pb2.RoutingPolicy:
        """Shift traffic between versions."""

        async def run(actor: str) -> admin_pb2.RoutingPolicy:
            policy = await self.rollout.set_weights(
                request.model,
                dict(request.weights),
                expected=request.expected_revision,
                actor=actor,
                reason=request.reason,
            )
            return policy_to_proto(policy)

        return await self._run(context, "SetWeights", run)

    async def Rollback(
        self, request: admin_pb2.RollbackRequest, context: Context
    ) -> admin_pb2.RoutingPolicy:
        """All traffic back to the stable version (or ``to_version``) at once."""

        async def run(actor: str) -> admin_pb2.RoutingPolicy:
            policy = await self.rollout.rollback(
                request.model,
                to_version=request.to_version,
                reason=request.reason,
                keep_pins=request.keep_pins,
                actor=actor,
            )
            return policy_to_proto(policy)

        return await self._run(context, "Rollback", run)

    async def Promote(
        self, request: admin_pb2.PromoteRequest, context: Context
    ) -> admin_pb2.RoutingPolicy:
        """Make ``version`` the stable one with all the weight."""

        async def run(actor: str) -> admin_pb2.RoutingPolicy:
            policy = await self.rollout.promote(
                request.model, request.version, actor=actor, reason=request.reason
            )
            return policy_to_proto(policy)

        return await self._run(context, "Promote", run)

    async def GetRolloutStatus(
        self, request: admin_pb2.GetRolloutStatusRequest, context: Context
    ) -> admin_pb2.RolloutStatus:
        """The policy, per-version numbers on this replica, and the guard's verdict."""

        async def run(actor: str) -> admin_pb2.RolloutStatus:
            policy = await self.rollout.get(request.model)
            return status_to_proto(policy, self.pool, self.stats, self.judge(policy, self.stats))

        return await self._run(context, "GetRolloutStatus", run)

    async def ListModelRoutes(
        self, request: admin_pb2.ListModelRoutesRequest, context: Context
    ) -> admin_pb2.ListModelRoutesResponse:
        """Every model route, by name."""

        async def run(actor: str) -> admin_pb2.ListModelRoutesResponse:
            routes = await self.routes.list()
            return admin_pb2.ListModelRoutesResponse(routes=[route_to_proto(r) for r in routes])

        return await self._run(context, "ListModelRoutes", run)

    async def SetModelRoute(
        self, request: admin_pb2.ModelRoute, context: Context
    ) -> admin_pb2.ModelRoute:
        """Create or replace a route (every replica follows within the cache bound)."""

        async def run(actor: str) -> admin_pb2.ModelRoute:
            targets = tuple(RouteTarget(t.model, t.version) for t in request.targets)
            route = ModelRoute(request.name, targets)
            return route_to_proto(await self.routes.set(route, actor, request.reason))

        return await self._run(context, "SetModelRoute", run)

    async def DeleteModelRoute(
        self, request: admin_pb2.DeleteModelRouteRequest, context: Context
    ) -> admin_pb2.DeleteModelRouteResponse:
        """Remove a route: its name then means the model of that name, if any."""

        async def run(actor: str) -> admin_pb2.DeleteModelRouteResponse:
            deleted = await self.routes.delete(request.name, actor)
            return admin_pb2.DeleteModelRouteResponse(deleted=deleted)

        return await self._run(context, "DeleteModelRoute", run)


def route_to_proto(route: ModelRoute) -> admin_pb2.ModelRoute:
    """The admin message of a stored route."""
    msg = admin_pb2.ModelRoute(
        name=route.name,
        targets=[admin_pb2.RouteTarget(model=t.model, version=t.version) for t in route.targets],
        updated_by=route.updated_by,
    )
    msg.updated_at.FromNanoseconds(int(route.updated_at * 1e9))
    return msg


def add_to_server(servicer: RoutingAdminServicer, server: grpc.aio.Server) -> list[str]:
    """Mount the servicer; returns the full service name for health and reflection."""
    admin_pb2_grpc.add_RoutingAdminServicer_to_server(servicer, server)
    return [SERVICE_NAME]
