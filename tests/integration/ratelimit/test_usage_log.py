"""Usage records on a real Redis: batching, day keys with retention, queries, exports,
and nothing lost while Redis is away (within the queue's bound)."""

from __future__ import annotations

from datetime import UTC, date, datetime

import pytest
from redis.asyncio import Redis

from common.redis_server import free_port
from ratelimit.errors import StoreError
from ratelimit.usage.records import UsageEvent, UsageLog, day_range, to_csv

T0 = datetime(2026, 11, 30, 23, 59, tzinfo=UTC).timestamp()


def ev(tenant: str, key: str = "key_a", **kw: object) -> UsageEvent:
    fields: dict[str, object] = {
        "tenant_id": tenant,
        "key_id": key,
        "model": "m|x",
        "model_version": "v1",
        "status": "OK",
        "prompt_tokens": 10,
        "completion_tokens": 5,
        "cost_usd": 0.25,
        "time": T0,
    }
    fields.update(kw)
    return UsageEvent(**fields)  # type: ignore[arg-type]


async def test_records_add_up_per_day_key_model_version(redis_client: Redis, prefix: str) -> None:
    log = UsageLog(redis_client, prefix=prefix, retention_days=10)
    log.record(ev("t"))
    log.record(ev("t", cached_prompt_tokens=4))
    log.record(ev("t", status="CANCELLED", completion_tokens=1))
    log.record(ev("t", key="key_b", time=T0 + 120))  # the next day (UTC)
    log.record(ev("u"))
    assert await log.flush() == 5
    assert await log.flush() == 0
    recs = await log.query(tenant_id="t", start="2026-11-30", end="2026-12-01")
    assert [(r.date, r.key_id, r.model) for r in recs] == [
        ("2026-11-30", "key_a", "m_x"),  # "|" never inside a part of a field name
        ("2026-12-01", "key_b", "m_x"),
    ]
    first = recs[0]
    assert (first.requests, first.prompt_tokens, first.completion_tokens) == (3, 30, 11)
    assert first.cached_prompt_tokens == 4
    assert first.cost_usd == pytest.approx(0.75)
    assert first.errors == {"CANCELLED": 1}
    # a day's records expire retention_days after that day ends
    ttl = await redis_client.ttl(f"{prefix}usage:{{t}}:2026-11-30")
    expected = (
        datetime(2026, 12, 1, tzinfo=UTC).timestamp() + 10 * 86400 - datetime.now(UTC).timestamp()
    )
    assert abs(ttl - expected) < 60
    everyone = await log.query(start="2026-11-30", end="2026-11-30")
    assert {r.tenant_id for r in everyone} == {"t", "u"}
    only_b = await log.query(key_id="key_b", start="2026-11-30", end="2026-12-01")
    assert [r.key_id for r in only_b] == ["key_b"]
    lines = to_csv(recs).splitlines()
    assert lines[0].startswith("date,tenant_id,key_id,model,model_version,requests")
    assert lines[1].endswith(",CANCELLED=1")


async def test_records_wait_for_redis_and_the_oldest_go_first_past_the_bound(
    redis_client: Redis, prefix: str
) -> None:
    down = Redis(port=free_port(), decode_responses=True, socket_connect_timeout=0.2)
    log = UsageLog(down, prefix=prefix, max_queued=3)
    log.record(ev("t", prompt_tokens=1))
    with pytest.raises(StoreError):
        await log.flush()
    for n in (2, 3, 4):
        log.record(ev("t", prompt_tokens=n))  # the fourth record pushes out the first
    log.client = redis_client  # Redis is back
    assert await log.flush() == 3
    (rec,) = await log.query(tenant_id="t", start="2026-11-30", end="2026-11-30")
    assert (rec.requests, rec.prompt_tokens) == (3, 2 + 3 + 4)
    await down.aclose()


def test_query_ranges_default_to_the_last_30_days() -> None:
    days = day_range("", "", date(2026, 12, 1))
    assert (days[0], days[-1], len(days)) == ("2026-11-02", "2026-12-01", 30)


async def test_a_batch_writes_one_increment_per_counter_not_per_request(
    redis_client: Redis, prefix: str
) -> None:
    log = UsageLog(redis_client, prefix=prefix)
    for _ in range(50):
        log.record(ev("t"))
    log.record(ev("t", status="CANCELLED"))

    async def calls(command: str) -> int:
        stats = await redis_client.info("commandstats")
        return int(stats.get(f"cmdstat_{command}", {"calls": 0})["calls"])

    before = await calls("hincrby"), await calls("hincrbyfloat")
    assert await log.flush() == 51
    after = await calls("hincrby"), await calls("hincrbyfloat")
    # requests, prompt_tokens, completion_tokens and errors:CANCELLED; one cost_usd
    assert (after[0] - before[0], after[1] - before[1]) == (4, 1)
    (rec,) = await log.query(tenant_id="t", start="2026-11-30", end="2026-11-30")
    assert (rec.requests, rec.prompt_tokens, rec.completion_tokens) == (51, 510, 255)
    assert rec.cost_usd == pytest.approx(51 * 0.25)
    assert rec.errors == {"CANCELLED": 1}
