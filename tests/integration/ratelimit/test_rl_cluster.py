"""The rate-limit stack on a real Redis Cluster (3 primaries, 1 replica each).

Every operation of the limiter, the registry, the audit log, usage records,
budgets, replica membership, routing policies and model routes runs through
redis-py's cluster client and must succeed: a script or transaction whose keys
hash to two slots would be refused with CROSSSLOT (by the client before it is
sent, or by the server). A static check hashes every Lua script's KEYS for
sample tenants, and a control shows the cluster does refuse a cross-slot script.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot
from redis.exceptions import RedisClusterException, ResponseError

from common.redis_cluster import RedisClusterServers
from gateway.release import policy_store
from gateway.release.model_routes import ModelRoute, RouteStore, RouteTarget
from gateway.release.policy_store import RedisPolicyStore
from gateway.routing_policy import RoutingPolicy
from ratelimit.budget import ledger
from ratelimit.budget.ledger import BudgetLedger
from ratelimit.budget.policy import Budget, Metric, Period, Price
from ratelimit.config import LimitPolicy, RateLimitConfig, Tenant
from ratelimit.factory import RateLimitStack
from ratelimit.limiter import lua, membership
from ratelimit.limiter.storage import redis as redis_storage
from ratelimit.limiter.storage.redis import bucket_keys
from ratelimit.redis_scripts import LuaScript
from ratelimit.store_guard import StoreGuard
from ratelimit.tenancy.records import KeyRole
from ratelimit.usage.records import UsageEvent

pytestmark = pytest.mark.integration

TENANTS = ("team-a", "team-b", "team-c", "x", "a.b-c_9", "Z" * 64, "0")
BUDGETS = (
    Budget("daily", Metric.TOKENS, Period.DAY, 10_000, timezone="Europe/Berlin"),
    Budget("spend", Metric.COST, Period.MONTH, 25.0),
    Budget("hourly", Metric.TOKENS, Period.HOUR, 5_000, rolling=True),
)
PRICE = Price(prompt_per_million=1.0, completion_per_million=2.0)


def script_keys(prefix: str, tenant: str) -> dict[str, list[list[str]]]:
    """The KEYS of every call of every Lua script, as the code builds them."""
    bucket = list(bucket_keys(prefix, tenant))
    budget = BudgetLedger(None, StoreGuard(100), prefix=prefix)._keys(tenant, BUDGETS)  # type: ignore[arg-type]
    return {
        "reserve": [bucket[:3]],
        "take": [bucket],
        "settle": [bucket],
        "heartbeat": [bucket[1::2]],
        "usage": [bucket[:3]],
        "budget_charge": [budget, budget[:3]],
        "budget_settle": [budget],
        "replicas": [[f"{prefix}replicas"]],
        "gateway.release.policy_store._CAS": [[RedisPolicyStore(None, prefix).key]],  # type: ignore[arg-type]
    }


def lua_scripts() -> set[str]:
    """Every Lua script the modules define: a ``LuaScript``'s name, or ``module.NAME`` of a
    source sent by EVAL (a new script must be added to ``script_keys``)."""
    modules = (lua, redis_storage, membership, ledger, policy_store)
    named = {
        v.source: v.name for m in modules for v in vars(m).values() if isinstance(v, LuaScript)
    }
    return {
        named.get(v, f"{m.__name__}.{k}")
        for m in modules
        for k, v in vars(m).items()
        if isinstance(v, str) and "redis.call(" in v and "KEYS[" in v
    }


def test_every_lua_script_touches_one_slot_per_tenant() -> None:
    assert lua_scripts() == set(script_keys("rl:", "t"))
    slots_of_tenants = set()
    for prefix in ("rl:", "prod:rl:"):
        for tenant in TENANTS:
            for name, calls in script_keys(prefix, tenant).items():
                for keys in calls:
                    assert len({key_slot(k.encode()) for k in keys}) == 1, (name, keys)
            slots_of_tenants.add(key_slot(bucket_keys(prefix, tenant)[0].encode()))
    # the hash tag is the tenant, not the prefix: tenants spread over the slots, and one
    # tenant's slot does not depend on the prefix
    assert len(slots_of_tenants) == len(TENANTS)


@pytest.fixture
async def stack(redis_cluster: RedisClusterServers, prefix: str) -> AsyncIterator[RateLimitStack]:
    config = RateLimitConfig(
        redis_url=redis_cluster.service_url, redis_cluster=True, key_prefix=prefix
    )
    s = RateLimitStack.from_config(config)
    try:
        await s.start(wait_s=10)
        yield s
    finally:
        await s.aclose()


async def test_the_cluster_refuses_a_cross_slot_script(stack: RateLimitStack) -> None:
    """The control: with keys in two slots the same calls would fail."""
    a, b = bucket_keys(stack.config.key_prefix, "team-a")[0], f"{stack.config.key_prefix}x"
    assert key_slot(a.encode()) != key_slot(b.encode())
    with pytest.raises((RedisClusterException, ResponseError), match=r"(?i)slot"):
        await stack.client.eval("return 1", 2, a, b)  # type: ignore[misc]


async def test_every_operation_works_on_the_cluster(
    redis_cluster: RedisClusterServers, stack: RateLimitStack
) -> None:
    assert isinstance(stack.client, RedisCluster)
    prefix = stack.config.key_prefix
    tenants = [
        # tokens refill at 1/s: levels below stay near what the calls left
        Tenant(t, LimitPolicy(requests_per_minute=600, tokens_per_minute=60, token_burst=10_000))
        for t in ("team-a", "team-b", "team-c", "team-d", "team-e")
    ]
    # the tenants' keys live on more than one shard, so routing is really exercised
    owners = {redis_cluster.primary_of(bucket_keys(prefix, t.tenant_id)[0]) for t in tenants}
    assert len(owners) >= 2

    # registry: tenants, keys, authentication, rotation, revocation, last use
    for t in tenants:
        await stack.registry.upsert_tenant(t)
    assert [t.tenant_id for t in await stack.registry.list_tenants()] == [
        t.tenant_id for t in tenants
    ]
    admin_plain, admin = await stack.registry.create_key("", "ops", KeyRole.ADMIN)
    plain, key = await stack.registry.create_key("team-a", "ci", KeyRole.TENANT, owner="alice")
    principal = await stack.registry.authenticate(plain)
    assert principal.tenant is not None
    assert principal.tenant.tenant_id == "team-a"
    assert (await stack.registry.authenticate(admin_plain, KeyRole.ADMIN)).key.key_id == (
        admin.key_id
    )
    new_plain, new, old = await stack.registry.rotate_key(key.key_id, 60)
    assert [k.key_id for k in await stack.registry.list_keys("team-a")] == [key.key_id, new.key_id]
    await stack.registry.revoke_key(old.key_id)
    stack.registry.auth.clear()
    assert (await stack.registry.authenticate(new_plain)).key.key_id == new.key_id
    await asyncio.gather(*stack.registry._background)  # the last-use writes
    assert set(await stack.registry.last_used([new.key_id, old.key_id, admin.key_id])) == {
        new.key_id,
        old.key_id,
        admin.key_id,
    }

    # limiter: reserve, take, heartbeat, settle, usage, reset, forget on every shard
    for t in tenants:
        first = await stack.limiter.reserve(t, 0)
        assert first.source == "redis"
        assert first.reservation is not None
        took = await stack.limiter.take(t, first.reservation, 100)
        assert took.allowed
        assert took.source == "redis"
        assert await stack.store.heartbeat(t.tenant_id, first.reservation.lease_id)
        await stack.limiter.settle(first.reservation, prompt_tokens=30, completion_tokens=20)
        second = await stack.limiter.reserve(t, 500)
        assert second.reservation is not None
        await stack.limiter.release(second.reservation)
        usage = await stack.limiter.usage(t)
        assert (usage.requests_total, usage.prompt_tokens_total, usage.concurrent_in_use) == (
            2,
            30,
            0,
        )
        # settle charged 50 of the 100 taken; release kept the 500 reserved
        assert 10_000 - 550 <= usage.tokens_available < 10_000 - 400
    await stack.limiter.reset("team-a")
    assert (await stack.limiter.usage(tenants[0])).tokens_available == 10_000
    await stack.limiter.forget("team-b")
    assert (await stack.limiter.usage(tenants[1])).requests_total == 0

    # budgets: charge, settle, levels, reset
    for t in tenants:
        d = await stack.budgets.charge(t.tenant_id, BUDGETS, PRICE, prompt_tokens=10, max_tokens=90)
        assert d.hold is not None
        assert await stack.budgets.settle(d.hold, prompt_tokens=10, completion_tokens=40)
        levels = await stack.budgets.levels(t.tenant_id, BUDGETS)
        assert [lv.used for lv in levels] == pytest.approx([50, 10e-6 + 80e-6, 50])
    await stack.budgets.reset("team-c", BUDGETS)
    assert [lv.used for lv in await stack.budgets.levels("team-c", BUDGETS)] == [0, 0, 0]

    # audit log (a MULTI on one key), usage records (a pipeline over every shard)
    await stack.audit.record(admin.key_id, "UpsertTenant", "team-a", {"rpm": 600})
    assert [e.target for e in await stack.audit.list()] == ["team-a"]
    for t in tenants:
        stack.usage.record(UsageEvent(t.tenant_id, key.key_id, "m", "v1", "OK", 10, 0, 40))
    assert await stack.usage.flush() == len(tenants)
    records = await stack.usage.query()
    assert sorted((r.tenant_id, r.requests, r.completion_tokens) for r in records) == [
        (t.tenant_id, 1, 40) for t in tenants
    ]

    # replica membership
    await stack.membership.refresh()
    assert stack.membership.count == 1

    # routing policies (compare-and-set script) and model routes
    policies = RedisPolicyStore(stack.client, prefix)
    policy = RoutingPolicy("m", "v1", weights={"v1": 100}, revision=1)
    assert await policies.compare_and_set("m", 0, policy)
    assert not await policies.compare_and_set("m", 0, policy)
    assert (await policies.load_all())["m"].revision == 1
    assert await policies.compare_and_set("m", 1, None)
    routes = RouteStore(stack.client, prefix)
    await routes.put(ModelRoute("chat", (RouteTarget("m", "v1"),)))
    assert list(await routes.load_all()) == ["chat"]
    assert await routes.delete("chat")

    # deleting a tenant revokes its keys
    assert await stack.registry.delete_tenant("team-a") == 1
    assert [t.tenant_id for t in await stack.registry.list_tenants()] == [
        t.tenant_id for t in tenants[1:]
    ]
