"""Budgets in Redis: reserve at admission, settle to the exact usage, across replicas.

Keys (hash-tagged by tenant, so one Redis Cluster slot per tenant, like the
limiter's)::

    <p>{<t>}:B:<name>:<period><c|r>   hash  slot id (ms) -> amount charged in that slot
    <p>{<t>}:Bh                       hash  hold id -> "index:slot:amount,..." (open holds)
    <p>{<t>}:Bz                       zset  hold id -> time of the charge (stale holds)

``charge`` checks every budget of the tenant and, when all have room (or the
tenant is in shadow mode), adds the reservation (prompt + ``max_tokens``, or
their price) to the current slot of each, in one script: two gateway
replicas can never both take the last of a budget. ``settle`` gives back the
difference between what was reserved and what was used, to the slot it was
charged to, if that slot still counts (a period that has ended is gone). A
hold that is never settled (a gateway killed mid-stream) keeps its whole
reservation charged: budgets err on the side of the payer.

Calendar periods are computed from the gateway's clock (hosts keep NTP time);
the same instant gives every replica the same slot.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ratelimit.budget.policy import Budget, Price, Window, amount_text, charge_of
from ratelimit.redis_client import RedisClient, store_errors
from ratelimit.redis_scripts import LuaScript, load_scripts, run_script
from ratelimit.store_guard import StoreGuard

STALE_HOLD_MS = 86_400_000  # an open hold older than this is dropped (stays charged)

# KEYS: holds, hold times, budget_1..n
# ARGV: now, hold id, shadow (0/1), stale_ms, then per budget: slot, oldest, limit, amount, ttl
# Returns {allowed, refused index (0 = none), free slot (rolling refusals), used_1..n}
# with used_i the amount counted before this charge.
_CHARGE = """
local EPS = 1e-9
local now, hold = tonumber(ARGV[1]), ARGV[2]
local stale = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now - tonumber(ARGV[4]), 'LIMIT', 0, 32)
for _, id in ipairs(stale) do
  redis.call('HDEL', KEYS[1], id)
  redis.call('ZREM', KEYS[2], id)
end
local n = #KEYS - 2
local used, refused, free = {}, 0, -1
for i = 1, n do
  local a = 4 + (i - 1) * 5
  local oldest, limit = tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3])
  local amount = tonumber(ARGV[a + 4])
  local fields = redis.call('HGETALL', KEYS[2 + i])
  local sum, slots = 0, {}
  for j = 1, #fields, 2 do
    local s = tonumber(fields[j])
    if s < oldest then redis.call('HDEL', KEYS[2 + i], fields[j]) else
      local v = tonumber(fields[j + 1])
      sum = sum + v
      slots[#slots + 1] = {s, v}
    end
  end
  used[i] = string.format('%.17g', sum)
  if refused == 0 and amount > 0 and sum + amount > limit * (1 + EPS) then
    refused = i
    if amount <= limit then  -- the first slot whose ageing out makes room
      table.sort(slots, function(x, y) return x[1] < y[1] end)
      local left = sum
      for _, sv in ipairs(slots) do
        left = left - sv[2]
        if left + amount <= limit * (1 + EPS) then free = sv[1]; break end
      end
    end
  end
end
if redis.call('HEXISTS', KEYS[1], hold) == 1 then
  return {1, 0, -1, unpack(used)}  -- a retried call charges nothing twice
end
if refused ~= 0 and ARGV[3] ~= '1' then
  return {0, refused, free, unpack(used)}
end
local rec = {}
for i = 1, n do
  local a = 4 + (i - 1) * 5
  local amount = tonumber(ARGV[a + 4])
  if amount > 0 then
    redis.call('HINCRBYFLOAT', KEYS[2 + i], ARGV[a + 1], ARGV[a + 4])
    local ttl = tonumber(ARGV[a + 5])
    if redis.call('PTTL', KEYS[2 + i]) < ttl then redis.call('PEXPIRE', KEYS[2 + i], ttl) end
    rec[#rec + 1] = i .. ':' .. ARGV[a + 1] .. ':' .. ARGV[a + 4]
  end
end
if #rec > 0 then
  redis.call('HSET', KEYS[1], hold, table.concat(rec, ','))
  redis.call('ZADD', KEYS[2], now, hold)
  redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[4]) * 2)
  redis.call('PEXPIRE', KEYS[2], tonumber(ARGV[4]) * 2)
end
return {1, refused, -1, unpack(used)}
"""

# KEYS: holds, hold times, budget_1..n (as charged); ARGV: hold id, actual_1..n.
# Returns 1 when the hold was open (settled now), 0 when already settled or unknown.
_SETTLE = """
local rec = redis.call('HGET', KEYS[1], ARGV[1])
if not rec then return 0 end
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
for i, slot, amount in string.gmatch(rec, '(%d+):([^:,]+):([^,]+)') do
  local k = KEYS[2 + tonumber(i)]
  local refund = tonumber(amount) - tonumber(ARGV[1 + tonumber(i)])
  if refund ~= 0 and redis.call('HEXISTS', k, slot) == 1 then
    local left = tonumber(redis.call('HINCRBYFLOAT', k, slot, string.format('%.17g', -refund)))
    if left <= 1e-12 then redis.call('HDEL', k, slot) end
  end
end
return 1
"""

CHARGE = LuaScript("budget_charge", _CHARGE)
SETTLE = LuaScript("budget_settle", _SETTLE)
SCRIPTS = (CHARGE, SETTLE)


@dataclass(slots=True)
class BudgetHold:
    """An admitted request's reservation against its tenant's budgets.

    Attributes:
        tenant_id: The tenant charged.
        hold_id: Id of the hold in Redis.
        budgets: The budgets charged, in the order of the script's keys.
        price: The model's price (cost budgets).
        settled: Set by ``settle``; settling twice is a no-op.
    """

    tenant_id: str
    hold_id: str
    budgets: tuple[Budget, ...]
    price: Price
    settled: bool = False


@dataclass(frozen=True, slots=True)
class BudgetLevel:
    """One budget's spending in its current window."""

    budget: Budget
    used: float  # counted before the charge (for ``charge``), or now (for ``levels``)
    window: Window

    @property
    def percent(self) -> float:
        """``used`` as a percentage of the limit."""
        return 100.0 * self.used / self.budget.limit


@dataclass(frozen=True, slots=True)
class BudgetDecision:
    """What ``charge`` answers.

    Attributes:
        allowed: Proceed (True also when shadow mode admitted an over-budget request).
        hold: Settle it when the request ends (None when nothing was charged).
        levels: Each budget's spending before this charge.
        amounts: What this request reserved against each budget.
        refused: The first budget that had no room (also set when shadow-admitted).
        retry_after_ms: When refused: until the budget has room for this request
            (-1: never, the request alone is over the limit).
        resets_at_ms: When refused: when the period ends (calendar) or enough of the
            window has aged out (rolling).
        now_ms: The clock reading of the decision.
    """

    allowed: bool
    hold: BudgetHold | None
    levels: tuple[BudgetLevel, ...]
    amounts: tuple[float, ...]
    refused: BudgetLevel | None
    retry_after_ms: int
    resets_at_ms: float
    now_ms: float

    def warnings(self) -> list[BudgetLevel]:
        """Budgets whose soft threshold this charge crossed or stays over."""
        out = []
        for level, amount in zip(self.levels, self.amounts, strict=True):
            warn = level.budget.warn_percent
            if warn and level.used + amount >= level.budget.limit * warn / 100.0:
                out.append(BudgetLevel(level.budget, level.used + amount, level.window))
        return out

    def message(self, tenant_id: str) -> str:
        """A sentence a person can act on (for a refusal)."""
        level = self.refused
        if level is None:
            return f"tenant {tenant_id!r} is within its budgets"
        b = level.budget
        amount = self.amounts[self.levels.index(level)]
        whose = f"API key {b.owner} of tenant {tenant_id!r}" if b.owner else f"tenant {tenant_id!r}"
        head = (
            f"{whose} is over its budget {b.name!r} ({b.describe()}): "
            f"{amount_text(level.used, b.metric)} used, this request needs up to "
            f"{amount_text(amount, b.metric)}"
        )
        if self.retry_after_ms < 0:
            return head + "; it can never fit: lower max_tokens or shorten the prompt"
        resets = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.resets_at_ms / 1000))
        when = "resets" if not b.rolling else "has room again"
        return f"{head}; it {when} at {resets} (retry after {self.retry_after_ms} ms)"


class BudgetLedger:
    """Reserve -> settle against each tenant's budgets in Redis.

    Args:
        client: ``RedisClient`` (one server or a cluster) with ``decode_responses=True``.
        guard: Time budget and breaker of store calls (the limiter's, shared).
        prefix: Key prefix shared with the limiter and the registry.
        clock: Unix seconds (tests inject it).
    """

    def __init__(
        self,
        client: RedisClient,
        guard: StoreGuard,
        *,
        prefix: str = "rl:",
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.client = client
        self.guard = guard
        self.prefix = prefix
        self.clock = clock

    def _keys(self, tenant_id: str, budgets: Sequence[Budget]) -> list[str]:
        base = f"{self.prefix}{{{tenant_id}}}"
        keys = [f"{base}:Bh", f"{base}:Bz"]
        for b in budgets:
            keys.append(f"{base}:B:{b.label}:{b.period.name.lower()}{'r' if b.rolling else 'c'}")
        return keys

    async def load_scripts(self) -> None:
        """Load the scripts (start-up); raises ``StoreError`` if Redis is down."""
        await load_scripts(self.client, SCRIPTS)

    async def _run(self, script: LuaScript, keys: list[str], args: list[object]) -> Any:
        return await self.guard.call(
            script.name, lambda: run_script(self.client, script, keys, args)
        )

    async def charge(
        self,
        tenant_id: str,
        budgets: Sequence[Budget],
        price: Price,
        *,
        prompt_tokens: int,
        max_tokens: int,
        shadow: bool = False,
    ) -> BudgetDecision:
        """Reserve ``prompt_tokens + max_tokens`` (or their price) against every budget,
        all or nothing. Raises ``StoreError`` (the caller applies its fail mode)."""
        now_ms = self.clock() * 1000.0
        budgets = tuple(budgets)
        windows = [b.window(now_ms) for b in budgets]
        amounts = tuple(charge_of(b, price, prompt_tokens, max_tokens) for b in budgets)
        hold_id = uuid.uuid4().hex
        args: list[object] = [repr(now_ms), hold_id, int(shadow), STALE_HOLD_MS]
        for b, w, amount in zip(budgets, windows, amounts, strict=True):
            ttl = int(w.resets_at_ms - now_ms) + (w.slot_ms or 3_600_000)
            args += [w.slot, w.oldest, repr(float(b.limit)), repr(amount), max(ttl, 1000)]
        res = await self._run(CHARGE, self._keys(tenant_id, budgets), args)
        allowed, refused, free = int(str(res[0])), int(str(res[1])), int(str(res[2]))
        levels = tuple(
            BudgetLevel(b, float(str(u)), w)
            for b, u, w in zip(budgets, res[3:], windows, strict=True)
        )
        refused_level = levels[refused - 1] if refused else None
        retry, resets_at = 0, 0.0
        if refused_level is not None:
            w = refused_level.window
            resets_at = w.resets_at_ms
            if refused_level.budget.rolling and free >= 0:
                # room once slot `free` stops counting (span + 1 slots after its start)
                resets_at = free + (w.span + 1) * w.slot_ms
            retry = max(1, int(resets_at - now_ms))
            if amounts[refused - 1] > refused_level.budget.limit:
                retry = -1
        return BudgetDecision(
            allowed=bool(allowed),
            hold=BudgetHold(tenant_id, hold_id, budgets, price) if allowed else None,
            levels=levels,
            amounts=amounts,
            refused=refused_level,
            retry_after_ms=retry,
            resets_at_ms=resets_at,
            now_ms=now_ms,
        )

    async def settle(self, hold: BudgetHold, *, prompt_tokens: int, completion_tokens: int) -> bool:
        """Charge exactly what was used; the rest of the reservation goes back. Idempotent.
        True when the hold was open. Raises ``StoreError``."""
        if hold.settled:
            return False
        hold.settled = True
        actual = [
            repr(charge_of(b, hold.price, prompt_tokens, completion_tokens)) for b in hold.budgets
        ]
        keys = self._keys(hold.tenant_id, hold.budgets)
        return bool(await self._run(SETTLE, keys, [hold.hold_id, *actual]))

    async def levels(self, tenant_id: str, budgets: Sequence[Budget]) -> list[BudgetLevel]:
        """Each budget's spending now (read-only). Raises ``StoreError``."""
        now_ms = self.clock() * 1000.0
        keys = self._keys(tenant_id, budgets)[2:]
        with store_errors("budget read"):
            async with self.client.pipeline(transaction=False) as pipe:
                for key in keys:
                    pipe.hgetall(key)
                rows = await pipe.execute()
        out = []
        for b, row in zip(budgets, rows, strict=True):
            w = b.window(now_ms)
            used = sum(float(v) for s, v in row.items() if int(s) >= w.oldest)
            out.append(BudgetLevel(b, used, w))
        return out

    async def forget(self, tenant_id: str, budgets: Sequence[Budget]) -> None:
        """Drop the tenant's budget state (open holds and the listed budgets' slots)."""
        with store_errors("budget delete"):
            await self.client.delete(*self._keys(tenant_id, budgets))

    async def reset(self, tenant_id: str, budgets: Sequence[Budget]) -> None:
        """Zero the budgets' spending (open holds then settle against nothing)."""
        await self.forget(tenant_id, budgets)
