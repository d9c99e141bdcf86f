"""ScriptBatcher against a real Redis: concurrent script calls share round trips,
each still runs exactly once, and failures reach every waiting caller."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError

from common.redis_server import RedisServer
from ratelimit.redis_scripts import LuaScript, ScriptBatcher

pytestmark = pytest.mark.integration

COUNT = LuaScript("count", "return redis.call('INCR', KEYS[1])")


def key() -> str:
    return f"batch-test:{uuid.uuid4().hex}"


async def test_concurrent_calls_share_round_trips_and_each_runs_once(
    redis_client: Redis,
) -> None:
    await COUNT.load(redis_client)
    batcher = ScriptBatcher(redis_client, max_batch=16)
    k = key()
    assert await batcher(COUNT, [k], []) == 1  # idle: alone, at once
    assert batcher.num_round_trips == 1
    results = await asyncio.gather(*(batcher(COUNT, [k], []) for _ in range(100)))
    assert sorted(results) == list(range(2, 102))  # every call ran once, atomically
    assert batcher.num_calls == 101
    # the first went alone; the 99 that queued behind it went in batches of at most 16
    assert batcher.num_round_trips <= 2 + -(-99 // 16)
    assert await redis_client.get(k) == "101"


async def test_a_script_redis_lost_is_reloaded_for_the_calls_of_a_batch(
    redis_client: Redis,
) -> None:
    await COUNT.load(redis_client)
    await redis_client.script_flush()
    batcher = ScriptBatcher(redis_client)
    k = key()
    reloads = COUNT.num_reloads
    results = await asyncio.gather(*(batcher(COUNT, [k], []) for _ in range(10)))
    assert sorted(results) == list(range(1, 11))
    assert COUNT.num_reloads > reloads
    await redis_client.script_flush()  # now inside a pipeline: each NOSCRIPT is retried
    loop = asyncio.get_running_loop()
    batch: list[tuple[LuaScript, list[str], list[Any], asyncio.Future[Any]]] = [
        (COUNT, [k], [], loop.create_future()) for _ in range(5)
    ]
    await batcher._send(batch)  # type: ignore[arg-type]
    assert sorted(f.result() for _, _, _, f in batch) == list(range(11, 16))


async def test_a_caller_that_stops_waiting_does_not_take_its_call_back(
    redis_client: Redis,
) -> None:
    await COUNT.load(redis_client)
    batcher = ScriptBatcher(redis_client)
    k = key()
    first = asyncio.ensure_future(batcher(COUNT, [k], []))
    queued = [asyncio.ensure_future(batcher(COUNT, [k], [])) for _ in range(5)]
    await asyncio.sleep(0)
    queued[2].cancel()
    done = await asyncio.gather(first, *queued, return_exceptions=True)
    assert isinstance(done[3], asyncio.CancelledError)
    answered = {r for r in done if isinstance(r, int)}
    assert len(answered) == 5
    assert answered < set(range(1, 7))
    assert await redis_client.get(k) == "6"  # the abandoned call ran too
    assert await batcher(COUNT, [k], []) == 7  # and the batcher is free again


async def test_a_dead_server_fails_every_waiting_call_and_frees_the_batcher() -> None:
    server = RedisServer().start()
    client = Redis.from_url(server.url, decode_responses=True, socket_connect_timeout=1)
    try:
        await COUNT.load(client)
        batcher = ScriptBatcher(client)
        assert await batcher(COUNT, [key()], []) == 1
        server.close()
        results = await asyncio.wait_for(
            asyncio.gather(
                *(batcher(COUNT, [key()], []) for _ in range(20)), return_exceptions=True
            ),
            timeout=30,
        )
        assert all(isinstance(r, (RedisConnectionError, OSError)) for r in results), results
        assert not batcher._busy
        assert not batcher._queue
    finally:
        await client.aclose()
        server.close()


SLOW = LuaScript(
    "slow",
    """
    local t = redis.call('TIME')
    local start = t[1] * 1e6 + t[2]
    repeat
        t = redis.call('TIME')
    until t[1] * 1e6 + t[2] - start >= tonumber(ARGV[1])
    return redis.call('INCR', KEYS[1])
    """,
)


async def test_a_batch_past_its_timeout_fails_its_callers_and_is_not_sent_again(
    redis_client: Redis,
) -> None:
    """Redis stalls under a batch (a slow script in it): past the callers' budget the
    batch fails all of them, nothing in it runs twice, and the batcher is free again."""
    await COUNT.load(redis_client)
    await SLOW.load(redis_client)
    batcher = ScriptBatcher(redis_client, timeout_s=0.1)
    k, slow_key = key(), key()
    first = asyncio.ensure_future(batcher(COUNT, [k], []))  # goes alone, at once
    queued = [
        asyncio.ensure_future(batcher(SLOW, [slow_key], [400_000])),  # 0.4 s of Redis
        asyncio.ensure_future(batcher(COUNT, [k], [])),
    ]
    assert await first == 1
    results = await asyncio.gather(*queued, return_exceptions=True)
    assert all(isinstance(r, TimeoutError) for r in results), results
    assert not batcher._busy
    await asyncio.sleep(0.5)  # Redis finishes what it was sent
    assert await redis_client.get(slow_key) == "1"  # ran once: not resent
    assert await redis_client.get(k) == "2"
    assert await batcher(COUNT, [k], []) == 3
