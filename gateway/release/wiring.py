"""Wiring of model versions, canaries and rollback in one gateway process.

    ReleaseControl
      policies  PolicyCache over RedisPolicyStore (the ratelimit Redis and key prefix)
      stats     VersionStats: per-version outcomes on this replica
      router    VersionRouter: the version of each request (pipeline)
      shadow    ShadowMirror: shadow copies (pipeline)
      rollout   RolloutManager: audited policy changes (admin API, guard)
      guard     CanaryGuard: automatic rollback, every ``guard_interval_s``
      routes    RouteCache over RouteStore: model aliases and fallback chains (pipeline)

``build`` makes them and hooks the per-attempt outcomes of the dispatcher
into the stats; ``start`` seeds the configured policies (models that have
none in Redis yet) and starts the guard.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.log import get_logger
from gateway.config import GatewayConfig
from gateway.fleet.dispatcher import Dispatcher
from gateway.fleet.replica_pool import ReplicaPool
from gateway.release.canary_guard import CanaryGuard, judge
from gateway.release.model_routes import RouteCache, RouteManager, RouteStore
from gateway.release.policy_store import PolicyCache, RedisPolicyStore
from gateway.release.rollout import RolloutManager
from gateway.release.routing_admin import RoutingAdminServicer
from gateway.release.shadow import ShadowMirror
from gateway.release.version_router import VersionRouter
from gateway.release.version_stats import VersionStats
from gateway.routing_policy import policies_from_config
from ratelimit.errors import StoreError
from ratelimit.factory import RateLimitStack

log = get_logger(__name__)


@dataclass(slots=True)
class ReleaseControl:
    """The version-routing components of one gateway process."""

    config: GatewayConfig
    stack: RateLimitStack
    pool: ReplicaPool
    policies: PolicyCache
    stats: VersionStats
    router: VersionRouter
    shadow: ShadowMirror
    rollout: RolloutManager
    guard: CanaryGuard
    routes: RouteCache

    @classmethod
    def build(
        cls, config: GatewayConfig, stack: RateLimitStack, pool: ReplicaPool, dispatcher: Dispatcher
    ) -> ReleaseControl:
        """Wire everything; no I/O until ``start``."""
        store = RedisPolicyStore(stack.client, prefix=stack.config.key_prefix)
        policies = PolicyCache(store, ttl_s=config.routing_policy_cache_ms / 1000.0)
        stats = VersionStats()
        router = VersionRouter(policies, pool, stats)
        dispatcher.on_attempt = router.on_attempt
        rollout = RolloutManager(policies, stack.audit)
        guard = CanaryGuard(policies, stats, rollout.auto_rollback, config.guard_interval_s)
        shadow = ShadowMirror(pool, stats, config.shadow_max_in_flight)
        routes = RouteCache(
            RouteStore(stack.client, prefix=stack.config.key_prefix),
            ttl_s=config.routing_policy_cache_ms / 1000.0,
        )
        return cls(config, stack, pool, policies, stats, router, shadow, rollout, guard, routes)

    def servicer(self) -> RoutingAdminServicer:
        """The RoutingAdmin servicer over these components."""
        return RoutingAdminServicer(
            self.stack.registry,
            self.rollout,
            self.pool,
            self.stats,
            judge,
            RouteManager(self.routes, self.stack.audit),
        )

    async def start(self) -> None:
        """Seed the configured policies (Redis wins over the config), start the guard."""
        configured = policies_from_config(self.config.routing_policies)
        if configured:
            try:
                await self.policies.seed(configured)
            except StoreError as e:
                log.error("cannot seed routing policies from the config", error=str(e))
        self.guard.start()

    async def close(self) -> None:
        """Stop the guard, the shadow calls and any snapshot re-read in flight."""
        await self.guard.close()
        await self.shadow.close()
        await self.policies.close()
        await self.routes.close()
