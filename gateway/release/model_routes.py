"""Model routes: team-facing names (aliases) and fallback chains, changeable at run time.

A route maps a name callers use to an ordered list of targets (model, and
optionally version). A request naming the route goes to the first target with
a healthy replica whose context holds the prompt; the next targets are the
fallbacks. One route covers both needs:

* an alias: ``chat-small -> [SmolLM2-135M-Instruct]`` (optionally pinned to a
  version);
* a fallback chain for a real model, by giving the route that model's name:
  ``big-model -> [big-model, small-model]``.

Targets are models, never other routes (no recursion): ``RouteCache.put``
refuses a target that is another route's name, and a name another route
already targets. A fallback only goes to a model with the same tokenizer as
the first target served (equal ``ModelInfo.tokenizer_digest``): the prompt is
tokenized once, by that model's tokenizer.

    <ratelimit key_prefix>routing:routes   hash  route name -> JSON

The request path reads a local snapshot (``RouteCache``) refreshed from Redis
at most every ``ttl_s``, like the routing policies.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from typing import Any

from gateway.release.snapshot import SnapshotCache, read_json_hash
from ratelimit.redis_client import RedisClient
from ratelimit.tenancy.audit import AuditLog
from ratelimit.tenancy.registry import redis_errors

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/+-]{0,127}$")  # no '@': model@version
MAX_TARGETS = 8


@dataclass(frozen=True, slots=True)
class RouteTarget:
    """One model (and version, "" = any) a route may send a request to."""

    model: str
    version: str = ""

    def __str__(self) -> str:
        return f"{self.model}@{self.version}" if self.version else self.model


@dataclass(frozen=True, slots=True)
class ModelRoute:
    """A name and the targets it tries, in order."""

    name: str
    targets: tuple[RouteTarget, ...]
    updated_by: str = ""
    updated_at: float = 0.0

    def __post_init__(self) -> None:
        if not NAME_RE.match(self.name):
            raise ValueError(
                f"invalid route name {self.name!r}: 1-128 characters of letters, digits and "
                "'._:/+-', starting with a letter or digit"
            )
        if not 1 <= len(self.targets) <= MAX_TARGETS:
            raise ValueError(
                f"route {self.name!r} needs 1 to {MAX_TARGETS} targets, got {len(self.targets)}"
            )
        for t in self.targets:
            if not NAME_RE.match(t.model):
                raise ValueError(f"route {self.name!r}: invalid target model {t.model!r}")
            if t.version and not NAME_RE.match(t.version):
                raise ValueError(f"route {self.name!r}: invalid target version {t.version!r}")
        if len(set(self.targets)) != len(self.targets):
            raise ValueError(f"route {self.name!r} names a target twice")

    def to_dict(self) -> dict[str, object]:
        """JSON-ready form."""
        return {
            "targets": [{"model": t.model, "version": t.version} for t in self.targets],
            "updated_by": self.updated_by,
            "updated_at": self.updated_at,
        }

    @classmethod
    def from_dict(cls, name: str, d: dict[str, Any]) -> ModelRoute:
        """The inverse of ``to_dict``."""
        raw = d.get("targets", [])
        if not isinstance(raw, list):
            raise ValueError("targets must be a list")
        return cls(
            name=name,
            targets=tuple(RouteTarget(str(t["model"]), str(t.get("version", ""))) for t in raw),
            updated_by=str(d.get("updated_by", "")),
            updated_at=float(str(d.get("updated_at", 0.0))),
        )


class RouteStore:
    """Routes in one Redis hash (every gateway replica reads the same)."""

    def __init__(self, client: RedisClient, prefix: str = "rl:") -> None:
        self.client = client
        self.key = f"{prefix}routing:routes"

    async def load_all(self) -> dict[str, ModelRoute]:
        """Every stored route; a corrupt entry is logged and skipped."""
        return await read_json_hash(self.client, self.key, ModelRoute.from_dict, "model routes")

    async def put(self, route: ModelRoute) -> None:
        """Create or replace a route."""
        with redis_errors("model route write"):
            await self.client.hset(self.key, route.name, json.dumps(route.to_dict()))

    async def delete(self, name: str) -> bool:
        """Remove a route; False when there was none."""
        with redis_errors("model route delete"):
            return bool(await self.client.hdel(self.key, name))


class RouteCache(SnapshotCache[ModelRoute]):
    """The routes as the request path reads them (bounded staleness ``ttl_s``)."""

    def __init__(self, store: RouteStore, ttl_s: float = 1.0) -> None:
        super().__init__(store.load_all, ttl_s, "model routes")
        self.store = store

    async def put(self, route: ModelRoute) -> tuple[ModelRoute, ModelRoute | None]:
        """Store a route (stamped now) and use it on this replica at once.

        Returns:
            The stored route and the one it replaced (None = new).

        Raises:
            ValueError: the route would point to another route, or another route to it
                (checked against the store, not this replica's snapshot; two admins
                writing at the same moment on two replicas are not serialized).
        """
        existing = await self.store.load_all()
        check_no_chain(route, existing)
        stamped = ModelRoute(route.name, route.targets, route.updated_by, time.time())
        await self.store.put(stamped)
        self.set_local(stamped.name, stamped)
        return stamped, existing.get(route.name)

    async def delete(self, name: str) -> bool:
        """Remove a route here and in the store; False when there was none."""
        if not name:
            raise ValueError("name the route to delete (ListModelRoutes lists them)")
        found = await self.store.delete(name)
        self.set_local(name, None)
        return found

    async def targets(self, name: str, version: str = "") -> tuple[RouteTarget, ...]:
        """Where a request naming ``name`` (and ``version``) may go, in order: the route's
        targets (a version in the request overrides theirs), else ``name`` itself."""
        route = await self.get(name)
        if route is None:
            return (RouteTarget(name, version),)
        if version:
            return tuple(dict.fromkeys(RouteTarget(t.model, version) for t in route.targets))
        return route.targets


class RouteManager:
    """Audited changes to the routes (what the RoutingAdmin servicer calls).

    Args:
        routes: The shared route cache (Redis behind it).
        audit: The admin audit log (shared with RateLimitAdmin).
    """

    def __init__(self, routes: RouteCache, audit: AuditLog) -> None:
        self.routes = routes
        self.audit = audit

    async def list(self) -> list[ModelRoute]:
        """Every route, by name, read through to the store."""
        self.routes.invalidate()
        routes = await self.routes.all()
        return [routes[n] for n in sorted(routes)]

    async def set(self, route: ModelRoute, actor: str, reason: str) -> ModelRoute:
        """Create or replace ``route`` as ``actor``; every replica follows within the
        cache bound. Raises ``ValueError`` for a route to or from another route."""
        stored, previous = await self.routes.put(
            ModelRoute(route.name, route.targets, updated_by=actor)
        )
        detail = {
            "targets": [str(t) for t in stored.targets],
            "previous": [str(t) for t in previous.targets] if previous else [],
            "reason": reason,
        }
        await self.audit.record(actor, "SetModelRoute", f"route:{stored.name}", detail)
        return stored

    async def delete(self, name: str, actor: str) -> bool:
        """Remove a route (audited when there was one); its name then means the model
        of that name, if any."""
        deleted = await self.routes.delete(name)
        if deleted:
            await self.audit.record(actor, "DeleteModelRoute", f"route:{name}", {})
        return deleted


def check_no_chain(route: ModelRoute, existing: dict[str, ModelRoute]) -> None:
    """Raise ``ValueError`` when ``route`` would name another route as a target, or
    another route already names ``route.name`` (targets are models, resolved once).
    A target with the route's own name is the model of that name (a fallback chain)."""
    for t in route.targets:
        inner = existing.get(t.model)
        if t.model != route.name and inner is not None:
            models = ", ".join(str(x) for x in inner.targets)
            raise ValueError(
                f"target {t.model!r} of route {route.name!r} is itself a route (to {models}); "
                "routes cannot point to other routes: list those models as targets instead"
            )
    for other in existing.values():
        if other.name != route.name and any(t.model == route.name for t in other.targets):
            raise ValueError(
                f"route {other.name!r} already sends requests to {route.name!r}; routes cannot "
                f"point to other routes: change or delete route {other.name!r} first, or give "
                "this route another name"
            )
