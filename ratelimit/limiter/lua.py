"""The Lua side of the limiter and its caller (EVALSHA, reload on NOSCRIPT).

Every script touches only the keys of one tenant, all hash-tagged
``<prefix>{<tenant>}:...`` so they live in one Redis Cluster slot:

    {t}:b   hash  r, t (levels), ts (ms)   fields of unlimited dimensions absent;
                  PEXPIRE = time until full, so an idle tenant costs no memory
    {t}:l   zset  lease_id -> expiry ms     live leases (concurrent streams)
    {t}:u   hash  requests, prompt_tokens, completion_tokens, denied, shadow_denied
    {t}:k   hash  lease_id -> tokens TAKE took for it (given back or kept at SETTLE)

Unlimited is ``math.huge``, never a level value: a real level can go negative
(an overrun) and must not read as "no limit". A bucket's timestamp never moves
backwards, so a clock that steps back credits nothing twice.

The clock is Redis ``TIME`` (one clock for every gateway replica), unless the
caller passes ``now`` (tests inject it). ``decide``/``take``/``refund`` mirror
``ratelimit.limiter.algorithm`` statement for statement; keep them in step.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
from collections.abc import Sequence
from typing import Any

from redis.asyncio.cluster import RedisCluster
from redis.exceptions import NoScriptError

from ratelimit import metrics
from ratelimit.redis_client import RedisClient, store_errors

_PRELUDE = """
local EPS = 1e-6
local function clock(arg)
  if arg ~= '' then return tonumber(arg) end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
end
local function fmt(x) return string.format('%.17g', x) end
local function refill(level, cap, per_min, elapsed)
  if per_min == 0 then return math.huge end
  if level == nil then return cap end
  if elapsed < 0 then elapsed = 0 end
  return math.min(cap, level + elapsed * per_min / 60000)
end
local function rep(level)
  if level == math.huge then return '-1' end
  return fmt(math.max(0, level))
end
local function wait_ms(deficit, per_min)
  return math.max(1, math.ceil((deficit - EPS) * 60000 / per_min))
end
local function tokens_wait(t, cost, tpm, tcap)
  if tpm > 0 and cost > tcap then return -1 end
  if t < cost - EPS then return wait_ms(cost - t, tpm) end
  return 0
end
local function load(key, now, rpm, rcap, tpm, tcap)
  local b = redis.call('HMGET', key, 'r', 't', 'ts')
  local ts = tonumber(b[3]) or now
  local r = refill(tonumber(b[1]), rcap, rpm, now - ts)
  return r, refill(tonumber(b[2]), tcap, tpm, now - ts), math.max(ts, now)
end
local function save(key, ts, r, t, rpm, rcap, tpm, tcap)
  local ttl = 0
  redis.call('HSET', key, 'ts', fmt(ts))
  if rpm == 0 then redis.call('HDEL', key, 'r') else
    redis.call('HSET', key, 'r', fmt(r))
    ttl = math.max(ttl, (rcap - r) * 60000 / rpm)
  end
  if tpm == 0 then redis.call('HDEL', key, 't') else
    redis.call('HSET', key, 't', fmt(t))
    ttl = math.max(ttl, (tcap - t) * 60000 / tpm)
  end
  redis.call('PEXPIRE', key, math.ceil(ttl) + 1000)
end
local rpm, rcap = tonumber(ARGV[2]), tonumber(ARGV[3])
local tpm, tcap = tonumber(ARGV[4]), tonumber(ARGV[5])
"""

# KEYS: bucket, leases, usage
# ARGV: now, rpm, rcap, tpm, tcap, max_concurrent, num_tokens, lease_id, lease_ttl_ms,
#       shadow (0/1), concurrency_retry_ms
RESERVE = (
    _PRELUDE
    + """
local now = clock(ARGV[1])
local maxc, cost, lease_ttl = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[9])
local r, t, ts = load(KEYS[1], now, rpm, rcap, tpm, tcap)
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
local n = redis.call('ZCARD', KEYS[2])
local denied, wait, never = 0, 0, false
if r < 1 - EPS then
  denied = denied + 1
  wait = math.max(wait, wait_ms(1 - r, rpm))
end
local tw = tokens_wait(t, cost, tpm, tcap)
if tw ~= 0 then
  denied = denied + 2
  never = tw < 0
  wait = math.max(wait, tw)
end
if maxc > 0 and n >= maxc then
  denied = denied + 4
  local hint = tonumber(ARGV[11])
  local first = redis.call('ZRANGE', KEYS[2], 0, 0, 'WITHSCORES')
  if first[2] then hint = math.min(hint, math.max(1, math.ceil(tonumber(first[2]) - now))) end
  wait = math.max(wait, hint)
end
local allowed = 0
if denied == 0 then
  allowed = 1
  r, t = r - 1, t - cost
  save(KEYS[1], ts, r, t, rpm, rcap, tpm, tcap)
  redis.call('ZADD', KEYS[2], now + lease_ttl, ARGV[8])
  if redis.call('PTTL', KEYS[2]) < lease_ttl + 1000 then
    redis.call('PEXPIRE', KEYS[2], math.ceil(lease_ttl) + 1000)
  end
  n = n + 1
  redis.call('HINCRBY', KEYS[3], 'requests', 1)
elseif ARGV[10] == '1' then
  allowed = 1
  redis.call('HINCRBY', KEYS[3], 'requests', 1)
  redis.call('HINCRBY', KEYS[3], 'shadow_denied', 1)
else
  redis.call('HINCRBY', KEYS[3], 'denied', 1)
end
if never then wait = -1 end
return {allowed, denied, wait, rep(r), rep(t), n, fmt(now)}
"""
)

# KEYS: bucket, leases, usage, takes
# ARGV: now, rpm, rcap, tpm, tcap, num_tokens, lease_id, lease_ttl_ms, shadow (0/1)
# Tokens for a request RESERVE admitted with none (its request unit and lease are
# taken). Idempotent per lease: a retried call takes nothing twice.
TAKE = (
    _PRELUDE
    + """
local now = clock(ARGV[1])
local cost, lease_ttl = tonumber(ARGV[6]), tonumber(ARGV[8])
local r, t, ts = load(KEYS[1], now, rpm, rcap, tpm, tcap)
local n = redis.call('ZCOUNT', KEYS[2], '(' .. fmt(now), '+inf')
if redis.call('HEXISTS', KEYS[4], ARGV[7]) == 1 then
  return {1, 0, 0, rep(r), rep(t), n, fmt(now)}
end
local wait = tokens_wait(t, cost, tpm, tcap)
local denied, allowed = 0, 0
if wait ~= 0 then denied = 2 end
if denied == 0 then
  allowed = 1
  if cost > 0 and tpm > 0 then
    t = t - cost
    save(KEYS[1], ts, r, t, rpm, rcap, tpm, tcap)
    redis.call('HSET', KEYS[4], ARGV[7], cost)
    if redis.call('PTTL', KEYS[4]) < lease_ttl + 1000 then
      redis.call('PEXPIRE', KEYS[4], math.ceil(lease_ttl) + 1000)
    end
  end
elseif ARGV[9] == '1' then
  allowed = 1
  redis.call('HINCRBY', KEYS[3], 'shadow_denied', 1)
else
  redis.call('HINCRBY', KEYS[3], 'denied', 1)
end
return {allowed, denied, wait, rep(r), rep(t), n, fmt(now)}
"""
)

# KEYS: bucket, leases, usage, takes
# ARGV: now, rpm, rcap, tpm, tcap, refund_tokens, prompt_tokens, completion_tokens, lease_id,
#       only_if_held (0/1: refund only when the lease was still there; a reserve whose
#       outcome is unknown is compensated this way, exactly once),
#       refund_take (0/1: also give back what TAKE took for the lease; the caller's
#       refund_tokens never includes it, so an unknown TAKE outcome settles exactly)
SETTLE = (
    _PRELUDE
    + """
local now = clock(ARGV[1])
local refund = tonumber(ARGV[6])
local held = 0
if ARGV[9] ~= '' then held = redis.call('ZREM', KEYS[2], ARGV[9]) end
if ARGV[10] == '1' and held == 0 then refund = 0 end
if ARGV[9] ~= '' then
  local taken = tonumber(redis.call('HGET', KEYS[4], ARGV[9]))
  if taken then
    redis.call('HDEL', KEYS[4], ARGV[9])
    if ARGV[11] == '1' then refund = refund + taken end
  end
end
if refund ~= 0 and tpm > 0 then
  local r, t, ts = load(KEYS[1], now, rpm, rcap, tpm, tcap)
  t = math.min(tcap, t + refund)
  save(KEYS[1], ts, r, t, rpm, rcap, tpm, tcap)
end
if tonumber(ARGV[7]) > 0 then redis.call('HINCRBY', KEYS[3], 'prompt_tokens', ARGV[7]) end
if tonumber(ARGV[8]) > 0 then redis.call('HINCRBY', KEYS[3], 'completion_tokens', ARGV[8]) end
return held
"""
)

# KEYS: leases, takes; ARGV: now, lease_id, lease_ttl_ms
HEARTBEAT = """
local now
if ARGV[1] ~= '' then now = tonumber(ARGV[1]) else
  local t = redis.call('TIME'); now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
end
local expiry = tonumber(redis.call('ZSCORE', KEYS[1], ARGV[2]))
if expiry == nil or expiry <= now then return 0 end
local ttl = tonumber(ARGV[3])
redis.call('ZADD', KEYS[1], now + ttl, ARGV[2])
for i = 1, 2 do  -- a missing key (no takes) has PTTL -2; PEXPIRE leaves it missing
  if redis.call('PTTL', KEYS[i]) < ttl + 1000 then
    redis.call('PEXPIRE', KEYS[i], math.ceil(ttl) + 1000)
  end
end
return 1
"""

# KEYS: bucket, leases, usage; ARGV: now, rpm, rcap, tpm, tcap. Read-only.
USAGE = (
    _PRELUDE
    + """
local now = clock(ARGV[1])
local r, t = load(KEYS[1], now, rpm, rcap, tpm, tcap)
local n = redis.call('ZCOUNT', KEYS[2], '(' .. fmt(now), '+inf')
local u = redis.call('HMGET', KEYS[3], 'requests', 'prompt_tokens', 'completion_tokens',
  'denied', 'shadow_denied')
for i = 1, 5 do u[i] = tonumber(u[i]) or 0 end
return {rep(r), rep(t), n, u[1], u[2], u[3], u[4], u[5], fmt(now)}
"""
)


# KEYS: replicas zset; ARGV: replica id, ttl ms (or "" to leave). Returns live replicas.
# One clock (Redis TIME) for every replica, so skewed hosts count alike.
REPLICAS = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if ARGV[2] == '' then
  redis.call('ZREM', KEYS[1], ARGV[1])
else
  local ttl = tonumber(ARGV[2])
  redis.call('ZADD', KEYS[1], now + ttl, ARGV[1])
  redis.call('PEXPIRE', KEYS[1], ttl * 2)
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
return redis.call('ZCARD', KEYS[1])
"""


class LuaScript:
    """A script loaded once per server and called by EVALSHA.

    ``SCRIPT LOAD`` runs at start-up (``load``); if Redis forgets the script
    (restart, failover, ``SCRIPT FLUSH``) the NOSCRIPT reply triggers one
    reload and one retry, so recovery needs no restart of the caller.
    """

    def __init__(self, name: str, source: str) -> None:
        self.name = name
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()
        self.num_reloads = 0

    async def load(self, client: RedisClient) -> None:
        """Load the script into the server's script cache."""
        sha = await client.script_load(self.source)
        if sha != self.sha:
            raise RuntimeError(f"script {self.name}: server sha {sha} != local {self.sha}")

    async def __call__(self, client: RedisClient, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """Run the script; reload it once if the server lost it."""
        try:
            return await client.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            self.num_reloads += 1
            await self.load(client)
            return await client.evalsha(self.sha, len(keys), *keys, *args)


async def load_scripts(client: RedisClient, scripts: Sequence[LuaScript]) -> None:
    """Load ``scripts`` (start-up); raises ``StoreError`` if Redis is down."""
    with store_errors("script load"):
        for script in scripts:
            await script.load(client)


async def run_script(
    client: RedisClient, script: LuaScript, keys: Sequence[str], args: Sequence[Any]
) -> Any:
    """Run ``script``; a Redis failure surfaces as ``StoreError``."""
    with store_errors(script.name):
        return await script(client, keys, args)


_Call = tuple[LuaScript, Sequence[str], Sequence[Any], "asyncio.Future[Any]"]


class ScriptBatcher:
    """Script calls to one Redis server, coalesced while one is in flight.

    A call made when nothing is in flight goes out at once, alone (no added
    latency at low load). Calls made while a round trip is in flight queue up
    and go out together, as one pipeline (one write, one read), as soon as it
    ends, so under load N admissions and settlements cost one round trip and
    one wake-up of Redis and of this process instead of N. Each call still runs
    its own script atomically; a pipeline is not a transaction. A caller that
    stops waiting (cancelled, timed out) does not take its call back, exactly as
    with a call already written to the socket.

    For a Redis Cluster the calls go one by one (``batching`` False): its
    pipelines split by slot and node, which gains little for one tenant's keys.

    A batch gets ``timeout_s`` (the callers' own budget): past it each caller has
    given up, and a pipeline cut short is not resent (a script that ran must not run
    twice), so the next batch goes out at once.

    Args:
        client: The Redis client.
        max_batch: Most calls in one pipeline.
        timeout_s: Longest one batch may take (None = no bound).
    """

    def __init__(
        self, client: RedisClient, max_batch: int = 128, timeout_s: float | None = None
    ) -> None:
        self.client = client
        self.max_batch = max_batch
        self.timeout_s = timeout_s
        self._drainer: asyncio.Task[None] | None = None
        self.batching = not isinstance(client, RedisCluster)
        self._queue: collections.deque[_Call] = collections.deque()
        self._busy = False
        self.num_round_trips = 0
        self.num_calls = 0

    async def __call__(self, script: LuaScript, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """Run ``script`` (raises what the call raised; the caller maps store errors)."""
        self.num_calls += 1
        metrics.SCRIPT_CALLS.inc()
        if self.batching and self._busy:
            future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            self._queue.append((script, keys, args, future))
            return await future
        self._busy = self.batching  # the calls made while this one runs queue behind it
        try:
            self._round_trip()
            return await script(self.client, keys, args)
        finally:
            if self.batching:
                self._release()

    def _round_trip(self) -> None:
        self.num_round_trips += 1
        metrics.SCRIPT_ROUND_TRIPS.inc()

    def _release(self) -> None:
        if self._queue:
            self._drainer = asyncio.get_running_loop().create_task(
                self._drain(), name="redis-script-batch"
            )
        else:
            self._busy = False

    async def _drain(self) -> None:
        """Send what queued while busy, batch after batch, until nothing waits."""
        try:
            while self._queue:
                batch = [
                    self._queue.popleft() for _ in range(min(self.max_batch, len(self._queue)))
                ]
                self._round_trip()
                await self._send(batch)
        finally:
            self._busy = False

    async def _send(self, batch: list[_Call]) -> None:
        results: list[Any] = []
        try:
            async with asyncio.timeout(self.timeout_s):
                async with self.client.pipeline(transaction=False) as pipe:
                    for script, keys, args, _ in batch:
                        pipe.evalsha(script.sha, len(keys), *keys, *args)
                    results = await pipe.execute(raise_on_error=False)
                for i, ((script, keys, args, _), result) in enumerate(
                    zip(batch, results, strict=True)
                ):
                    if isinstance(result, NoScriptError):  # Redis lost it: reload, run alone
                        try:
                            results[i] = await script(self.client, keys, args)
                        except Exception as exc:
                            results[i] = exc
        except BaseException as exc:  # the connection failed or the time ran out: the
            for *_, future in batch:  # outcome of every call is unknown to its caller
                if not future.done():
                    future.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
            return
        for (*_, future), result in zip(batch, results, strict=True):
            if future.done():  # its caller stopped waiting
                continue
            if isinstance(result, Exception):
                future.set_exception(result)
            else:
                future.set_result(result)
