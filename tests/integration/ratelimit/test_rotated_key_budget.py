"""A rotated key inherits its predecessor's budget spending (real Registry and
BudgetLedger on a real Redis): rotation is no way to reset a key's budget."""

from __future__ import annotations

from redis.asyncio import Redis

from ratelimit.budget.ledger import BudgetLedger
from ratelimit.budget.policy import Budget, Metric, Period, Price
from ratelimit.config import LimitPolicy, Tenant
from ratelimit.store_guard import StoreGuard
from ratelimit.tenancy.records import KeyRole
from ratelimit.tenancy.registry import Registry

HOURLY = Budget("hourly", Metric.TOKENS, Period.HOUR, limit=100)


async def test_a_rotated_key_inherits_its_predecessors_spending(
    redis_client: Redis, prefix: str
) -> None:
    registry = Registry(redis_client, prefix=prefix)  # type: ignore[arg-type]
    ledger = BudgetLedger(redis_client, StoreGuard(2000), prefix=prefix)  # type: ignore[arg-type]
    await registry.upsert_tenant(Tenant("acme", LimitPolicy()))
    old_plain, old = await registry.create_key("acme", "app", KeyRole.TENANT, budgets=(HOURLY,))

    async def charge(plaintext: str, tokens: int) -> bool:
        key = (await registry.authenticate(plaintext)).key
        decision = await ledger.charge(
            "acme", key.budgets, Price(), prompt_tokens=tokens, max_tokens=0
        )
        return decision.allowed

    assert await charge(old_plain, 80)  # 80 of the key's 100 tokens this hour
    new_plain, new, _ = await registry.rotate_key(old.key_id, grace_s=60)
    assert new.key_id != old.key_id
    assert not await charge(new_plain, 30)  # 80 + 30 > 100: the spending came along
    assert await charge(new_plain, 15)  # 95
    assert not await charge(old_plain, 10)  # during the grace both count on one budget
    # a second rotation keeps the one set of counters
    newer_plain, _, _ = await registry.rotate_key(new.key_id, grace_s=0)
    assert not await charge(newer_plain, 10)
    assert await charge(newer_plain, 5)
    (level,) = await ledger.levels("acme", (await registry.get_key(new.key_id)).budgets)
    assert level.used == 100
