"""Model route changes: no route to or from another route, audited sets and deletes,
the writing replica's snapshot updated at once (a fake store and audit log)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any, cast

import pytest

from gateway.release.model_routes import (
    ModelRoute,
    RouteCache,
    RouteManager,
    RouteStore,
    RouteTarget,
    check_no_chain,
)
from ratelimit.tenancy.audit import AuditLog


class FakeStore:
    def __init__(self) -> None:
        self.routes: dict[str, ModelRoute] = {}

    async def load_all(self) -> dict[str, ModelRoute]:
        return dict(self.routes)

    async def put(self, route: ModelRoute) -> None:
        self.routes[route.name] = route

    async def delete(self, name: str) -> bool:
        return self.routes.pop(name, None) is not None


class FakeAudit:
    def __init__(self) -> None:
        self.events: list[tuple[str, str, str, dict[str, Any]]] = []

    async def record(self, actor: str, action: str, target: str, detail: Mapping[str, Any]) -> None:
        self.events.append((actor, action, target, dict(detail)))


def route(name: str, *targets: str) -> ModelRoute:
    return ModelRoute(name, tuple(RouteTarget(*t.split("@")) for t in targets))


def manager() -> tuple[RouteManager, FakeStore, FakeAudit]:
    store, audit = FakeStore(), FakeAudit()
    cache = RouteCache(cast(RouteStore, store), ttl_s=60.0)
    return RouteManager(cache, cast(AuditLog, audit)), store, audit


def test_a_route_may_name_itself_but_not_another_route() -> None:
    existing = {"big": route("big", "big", "small")}
    check_no_chain(route("big", "big", "tiny"), existing)  # replacing itself
    check_no_chain(route("chat", "small"), existing)
    with pytest.raises(ValueError, match=r"target 'big' of route 'chat' is itself a route"):
        check_no_chain(route("chat", "big"), existing)
    # ... and the message names the models to list instead
    with pytest.raises(ValueError, match="to big, small"):
        check_no_chain(route("chat", "big"), existing)


def test_a_name_another_route_targets_cannot_become_a_route() -> None:
    existing = {"chat": route("chat", "small")}
    with pytest.raises(ValueError, match="route 'chat' already sends requests to 'small'"):
        check_no_chain(route("small", "small", "tiny"), existing)


def test_set_and_delete_are_audited_and_seen_here_at_once() -> None:
    async def main() -> None:
        mgr, store, audit = manager()
        await mgr.routes.all()  # a snapshot taken before the write (ttl 60 s)
        stored = await mgr.set(route("chat", "m@v1"), "key_admin", "team alias")
        assert stored.updated_by == "key_admin"
        assert stored.updated_at > 0
        assert store.routes["chat"].targets == (RouteTarget("m", "v1"),)
        assert await mgr.routes.targets("chat") == (RouteTarget("m", "v1"),)
        await mgr.set(route("chat", "m", "n"), "key_admin", "add a fallback")
        assert [r.name for r in await mgr.list()] == ["chat"]
        assert await mgr.delete("chat", "key_admin") is True
        assert await mgr.delete("chat", "key_admin") is False  # nothing left: not audited
        assert await mgr.routes.targets("chat") == (RouteTarget("chat"),)
        assert [(e[1], e[2]) for e in audit.events] == [
            ("SetModelRoute", "route:chat"),
            ("SetModelRoute", "route:chat"),
            ("DeleteModelRoute", "route:chat"),
        ]
        assert audit.events[1][3] == {
            "targets": ["m", "n"],
            "previous": ["m@v1"],
            "reason": "add a fallback",
        }

    asyncio.run(main())


def test_a_refused_route_is_neither_stored_nor_audited() -> None:
    async def main() -> None:
        mgr, store, audit = manager()
        await mgr.set(route("big", "big", "small"), "a", "")
        with pytest.raises(ValueError, match="itself a route"):
            await mgr.set(route("chat", "big"), "a", "")
        with pytest.raises(ValueError, match="name the route"):
            await mgr.delete("", "a")
        assert set(store.routes) == {"big"}
        assert len(audit.events) == 1

    asyncio.run(main())


def test_a_version_in_the_request_overrides_the_targets_versions() -> None:
    async def main() -> None:
        mgr, _, _ = manager()
        await mgr.set(route("r", "m@v1", "m@v2", "n"), "a", "")
        assert await mgr.routes.targets("r", "v3") == (
            RouteTarget("m", "v3"),
            RouteTarget("n", "v3"),
        )

    asyncio.run(main())


def test_stored_routes_round_trip_and_names_exclude_the_version_separator() -> None:
    r = ModelRoute("chat", (RouteTarget("m", "v1"), RouteTarget("n")), "key_1", 12.5)
    assert ModelRoute.from_dict("chat", r.to_dict()) == r
    with pytest.raises(ValueError, match="invalid route name"):
        route("chat@v1", "m")
