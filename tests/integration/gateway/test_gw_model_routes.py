"""Model routes through the gateway: an alias serves from its model, shows in ListModels
and /v1/models, changes at run time through RoutingAdmin (audited), and a fallback chain
skips a target no replica serves."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator

import grpc
import pytest

from llm.v1 import admin_pb2, admin_pb2_grpc, gateway_pb2
from tests.integration.gateway.conftest import GatewayProcess, HttpGateway, chat

pytestmark = pytest.mark.integration


@pytest.fixture
def routing(gateway: GatewayProcess) -> Iterator[admin_pb2_grpc.RoutingAdminStub]:
    """The RoutingAdmin stub; every route is deleted afterwards, even when a test fails
    (the gateway and its Redis are shared by the whole session)."""
    stub = admin_pb2_grpc.RoutingAdminStub(gateway.channel)
    try:
        yield stub
    finally:
        routes = stub.ListModelRoutes(admin_pb2.ListModelRoutesRequest(), metadata=gateway.admin_md)
        for r in routes.routes:
            req = admin_pb2.DeleteModelRouteRequest(name=r.name)
            stub.DeleteModelRoute(req, metadata=gateway.admin_md)


def served_model(gw: GatewayProcess, key: str) -> str:
    cards = gw.stub.ListModels(
        gateway_pb2.ListModelsRequest(), metadata=(("authorization", f"Bearer {key}"),)
    )
    return next(c.id for c in cards.models if not c.route_targets)


def test_alias_and_fallback_routes_at_run_time(
    gateway: GatewayProcess,
    http_gateway: HttpGateway,
    routing: admin_pb2_grpc.RoutingAdminStub,
) -> None:
    _, key = gateway.tenant()
    model = served_model(gateway, key)
    alias = admin_pb2.ModelRoute(
        name="team-chat",
        targets=[admin_pb2.RouteTarget(model=model)],
        reason="a stable name for the chat team",
    )
    out = routing.SetModelRoute(alias, metadata=gateway.admin_md)
    assert out.updated_by != ""
    req = chat("Hi", max_tokens=3)
    req.model = "team-chat"
    chunks = gateway.generate(key, req)
    assert chunks[-1].usage.completion_tokens == 3
    cards = gateway.stub.ListModels(
        gateway_pb2.ListModelsRequest(), metadata=(("authorization", f"Bearer {key}"),)
    )
    card = next(c for c in cards.models if c.id == "team-chat")
    assert list(card.route_targets) == [model]
    # a fallback chain whose first target nobody serves goes to the next
    chain = admin_pb2.ModelRoute(
        name="with-fallback",
        targets=[admin_pb2.RouteTarget(model="not-deployed"), admin_pb2.RouteTarget(model=model)],
    )
    routing.SetModelRoute(chain, metadata=gateway.admin_md)
    req.model = "with-fallback"
    fallbacks = gateway.metric("gateway_model_fallbacks_total", reason="unavailable")
    assert gateway.generate(key, req)[-1].usage.completion_tokens == 3
    assert gateway.metric("gateway_model_fallbacks_total", reason="unavailable") == fallbacks + 1
    # the HTTP front of another replica sees the routes (Redis, within the cache bound)
    time.sleep(1.2)
    get = urllib.request.Request(
        f"{http_gateway.base_url}/models", headers={"authorization": f"Bearer {key}"}
    )
    with urllib.request.urlopen(get, timeout=30) as resp:
        listed = {m["id"]: m for m in json.loads(resp.read())["data"]}
    assert listed["team-chat"]["route_targets"] == [model]
    routes = routing.ListModelRoutes(admin_pb2.ListModelRoutesRequest(), metadata=gateway.admin_md)
    assert {"team-chat", "with-fallback"} <= {r.name for r in routes.routes}
    # a bad route is refused with what to fix; a deleted one is unknown again
    with pytest.raises(grpc.RpcError) as info:
        routing.SetModelRoute(admin_pb2.ModelRoute(name="empty"), metadata=gateway.admin_md)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "1 to 8 targets" in (info.value.details() or "")
    to_route = admin_pb2.ModelRoute(
        name="to-a-route", targets=[admin_pb2.RouteTarget(model="with-fallback")]
    )
    with pytest.raises(grpc.RpcError) as info:
        routing.SetModelRoute(to_route, metadata=gateway.admin_md)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "is itself a route" in (info.value.details() or "")
    # a route none of whose targets is served says where it leads
    nowhere = admin_pb2.ModelRoute(
        name="nowhere", targets=[admin_pb2.RouteTarget(model="not-deployed")]
    )
    routing.SetModelRoute(nowhere, metadata=gateway.admin_md)
    req.model = "nowhere"
    with pytest.raises(grpc.RpcError) as info:
        gateway.generate(key, req)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert "'nowhere' sends requests to not-deployed" in (info.value.details() or "")
    deleted = routing.DeleteModelRoute(
        admin_pb2.DeleteModelRouteRequest(name="team-chat"), metadata=gateway.admin_md
    )
    assert deleted.deleted
    req.model = "team-chat"
    with pytest.raises(grpc.RpcError) as info:
        gateway.generate(key, req)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    events = gateway.admin.ListAuditEvents(
        admin_pb2.ListAuditEventsRequest(limit=10), metadata=gateway.admin_md
    ).events
    actions = [(e.action, e.target) for e in events]
    assert ("DeleteModelRoute", "route:team-chat") in actions
    assert ("SetModelRoute", "route:team-chat") in actions


def test_a_tenant_limited_to_an_alias_reaches_its_model_only_through_it(
    gateway: GatewayProcess, routing: admin_pb2_grpc.RoutingAdminStub
) -> None:
    _, probe = gateway.tenant()
    model = served_model(gateway, probe)
    routing.SetModelRoute(
        admin_pb2.ModelRoute(name="only-this", targets=[admin_pb2.RouteTarget(model=model)]),
        metadata=gateway.admin_md,
    )
    tid, key = gateway.tenant()
    t = gateway.admin.GetTenant(
        admin_pb2.GetTenantRequest(tenant_id=tid), metadata=gateway.admin_md
    )
    t.allowed_models[:] = ["only-this"]
    gateway.admin.UpsertTenant(t, metadata=gateway.admin_md)
    req = chat("Hi", max_tokens=2)
    req.model = "only-this"
    assert gateway.generate(key, req)[-1].usage.completion_tokens == 2
    req.model = model
    with pytest.raises(grpc.RpcError) as info:
        gateway.generate(key, req)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "may not use model" in (info.value.details() or "")
    cards = gateway.stub.ListModels(
        gateway_pb2.ListModelsRequest(), metadata=(("authorization", f"Bearer {key}"),)
    )
    assert [c.id for c in cards.models] == ["only-this"]
