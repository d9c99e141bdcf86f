"""The Lua side of the limiter (its caller is ``ratelimit.redis_scripts``).

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
