"""Many processes x many coroutines hammering one tenant (exactness tests, benchmark).

Each worker process runs ``num_coroutines`` loops that call the limiter as
fast as they can until ``seconds`` have passed, and returns every admitted
decision's server timestamp plus latency samples. Workers start at a shared
wall-clock instant so the processes overlap. ``mode`` picks what is called:

- ``lua``: ``RedisStore.reserve`` alone (the script, without the limiter's
  budget, breaker, metrics and decision objects);
- ``bucket``: ``RateLimiter.reserve`` (the Lua token bucket, one EVALSHA);
- ``bucket_settle``: reserve, then settle (a whole request's limiter cost);
- ``fixed_window``: INCRBY + EXPIRE in one pipeline on a per-minute key,
  the algorithm of the Envoy ratelimit service, for comparison.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import multiprocessing
import time
import uuid
from dataclasses import dataclass, field

from ratelimit.config import LimitPolicy, Tenant
from ratelimit.limiter.rate_limiter import RateLimiter
from ratelimit.limiter.storage.redis import RedisStore
from ratelimit.redis_client import RedisClient, connect


@dataclass(frozen=True, slots=True)
class HammerSpec:
    """What one worker process does."""

    url: str
    prefix: str
    tenant_id: str
    policy: LimitPolicy
    seconds: float
    num_coroutines: int = 16
    num_tokens: int = 1
    mode: str = "bucket"
    start_at: float = 0.0  # time.time() to start at (0 = at once)
    cluster: bool = False  # url is a seed of a Redis Cluster (ratelimit.redis_client)


@dataclass(slots=True)
class HammerResult:
    """What one worker saw."""

    num_allowed: int = 0
    num_denied: int = 0
    num_errors: int = 0
    allowed_at_ms: list[float] = field(default_factory=list)  # server clock
    latencies_s: list[float] = field(default_factory=list)
    elapsed_s: float = 0.0


async def _fixed_window(client: RedisClient, key: str, limit: int) -> bool:
    window = int(time.time() // 60)
    pipe = client.pipeline(transaction=False)
    pipe.incrby(f"{key}:{window}", 1)
    pipe.expire(f"{key}:{window}", 60)
    count, _ = await pipe.execute()
    return int(count) <= limit


async def _loop(
    spec: HammerSpec, limiter: RateLimiter, client: RedisClient, out: HammerResult, stop_at: float
) -> None:
    tenant = Tenant(spec.tenant_id, spec.policy)
    key = f"{spec.prefix}fw:{spec.tenant_id}"
    while time.perf_counter() < stop_at:
        t0 = time.perf_counter()
        if spec.mode == "fixed_window":
            allowed = await _fixed_window(client, key, spec.policy.requests_per_minute)
        elif spec.mode == "lua":
            outcome = await limiter.store.reserve(
                spec.tenant_id,
                spec.policy,
                num_tokens=spec.num_tokens,
                lease_id=uuid.uuid4().hex,
                shadow=False,
            )
            allowed = outcome.allowed
        else:
            decision = await limiter.reserve(tenant, spec.num_tokens)
            allowed = decision.allowed
            if decision.reservation is not None:
                out.allowed_at_ms.append(decision.server_time_ms)
                if spec.mode == "bucket_settle":
                    await limiter.settle(
                        decision.reservation, prompt_tokens=spec.num_tokens, completion_tokens=0
                    )
        out.latencies_s.append(time.perf_counter() - t0)
        if allowed:
            out.num_allowed += 1
        else:
            out.num_denied += 1


async def _run(spec: HammerSpec) -> HammerResult:
    client = connect(
        spec.url, cluster=spec.cluster, decode_responses=True, max_connections=spec.num_coroutines
    )
    store = RedisStore(client, prefix=spec.prefix)
    limiter = RateLimiter(store, fail_mode="closed", timeout_ms=5000)
    await store.load_scripts()
    await client.ping()
    delay = spec.start_at - time.time()
    if delay > 0:
        await asyncio.sleep(delay)
    out = HammerResult()
    start = time.perf_counter()
    stop_at = start + spec.seconds
    await asyncio.gather(
        *(_loop(spec, limiter, client, out, stop_at) for _ in range(spec.num_coroutines))
    )
    out.elapsed_s = time.perf_counter() - start
    await client.aclose()
    return out


def excess_over_policy(times_ms: list[float], policy: LimitPolicy, num_tokens: int) -> float:
    """The most admissions of ``num_tokens`` each that any interval of ``times_ms``
    (sorted server timestamps) holds beyond what ``policy`` allows in it (a full
    bucket at its start plus the refill over it); <= 0 when the limiter was exact."""
    per_ms = policy.requests_per_minute / 60_000
    cap = float(policy.request_capacity)
    if policy.tokens_per_minute and num_tokens:
        per_ms = min(per_ms, policy.tokens_per_minute / num_tokens / 60_000)
        cap = min(cap, policy.token_capacity // num_tokens)
    worst = -math.inf
    for i in range(len(times_ms)):
        for j in range(i, len(times_ms)):
            worst = max(worst, j - i + 1 - cap - (times_ms[j] - times_ms[i]) * per_ms)
    return worst


def run_worker(spec: HammerSpec) -> HammerResult:
    """Entry point of one worker process."""
    return asyncio.run(_run(spec))


def hammer(spec: HammerSpec, num_processes: int) -> list[HammerResult]:
    """Run ``num_processes`` workers (spawned, not forked) and collect their results."""
    specs = [spec] * num_processes
    if num_processes == 1:
        return [run_worker(spec)]
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(num_processes) as pool:
        # the start instant is set once the pool exists, so spawn time is not lost
        specs = [dataclasses.replace(s, start_at=time.time() + 1.5) for s in specs]
        return pool.map(run_worker, specs)
