"""Usage records: tenant x key x model x version x day, kept after the tenant is gone.

Keys (the per-tenant hash is hash-tagged by tenant, one Redis Cluster slot each)::

    <p>usage_tenants              set   every tenant that ever had a record
    <p>usage:{<t>}:<YYYY-MM-DD>   hash  "<key>|<model>|<version>|<counter>" -> count

Counters: ``requests``, ``prompt_tokens``, ``cached_prompt_tokens``,
``completion_tokens``, ``cost_usd`` (a float) and ``errors:<STATUS>`` per gRPC
status of requests that did not end OK. Days are UTC. Each day's hash expires
``retention_days`` after that day; deleting a tenant or a key leaves them.

Recording is off the request path: the gateway queues a record when a request
ends and one background task writes queued records in batches (one pipelined
round trip per batch). The queue is bounded; when Redis is away longer than the
queue lasts, the oldest records are dropped and counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import io
import json
import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, date, datetime, timedelta

from common.log import get_logger
from common.tasks import cancel_and_wait
from ratelimit import metrics
from ratelimit.errors import StoreError
from ratelimit.redis_client import STORE_FAILURES, RedisClient, is_store_failure, store_errors

log = get_logger(__name__)
COUNTERS = ("requests", "prompt_tokens", "cached_prompt_tokens", "completion_tokens")
MAX_QUERY_DAYS = 400
DEFAULT_QUERY_DAYS = 30
CSV_COLUMNS = (
    "date",
    "tenant_id",
    "key_id",
    "model",
    "model_version",
    *COUNTERS,
    "cost_usd",
    "errors",
)


@dataclass(frozen=True, slots=True)
class UsageEvent:
    """One finished request, as the gateway saw it."""

    tenant_id: str
    key_id: str
    model: str
    model_version: str
    status: str  # gRPC status name, "OK" for success
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: float = 0.0
    time: float = 0.0  # unix seconds (0 = now)


@dataclass(slots=True)
class UsageRecord:
    """The totals of one (day, tenant, key, model, version)."""

    date: str
    tenant_id: str
    key_id: str
    model: str
    model_version: str
    requests: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: float = 0.0
    errors: dict[str, int] = field(default_factory=dict)


def _day(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).date().isoformat()


def parse_day(text: str, name: str) -> date:
    """``YYYY-MM-DD`` or ValueError naming the field."""
    try:
        return date.fromisoformat(text)
    except ValueError:
        raise ValueError(f"{name} must be a date as YYYY-MM-DD, got {text!r}") from None


def day_range(start: str, end: str, today: date) -> list[str]:
    """Days from ``start`` to ``end`` inclusive ("" = 30 days back / today)."""
    last = parse_day(end, "end_date") if end else today
    first = parse_day(start, "start_date") if start else last - timedelta(DEFAULT_QUERY_DAYS - 1)
    if first > last:
        raise ValueError(f"start_date {first} is after end_date {last}")
    span = (last - first).days + 1
    if span > MAX_QUERY_DAYS:
        raise ValueError(f"at most {MAX_QUERY_DAYS} days per query, asked for {span}")
    return [(first + timedelta(i)).isoformat() for i in range(span)]


class UsageLog:
    """Writes and reads usage records in Redis.

    Args:
        client: ``RedisClient`` (one server or a cluster) with ``decode_responses=True``.
        prefix: Key prefix shared with the limiter and the registry.
        retention_days: How long a day's records are kept.
        max_queued: Records waiting for Redis at most (the oldest are dropped beyond).
        flush_interval_s: How often queued records are written.
    """

    def __init__(
        self,
        client: RedisClient,
        *,
        prefix: str = "rl:",
        retention_days: int = 400,
        max_queued: int = 100_000,
        flush_interval_s: float = 0.5,
    ) -> None:
        self.client = client
        self.prefix = prefix
        self.retention_s = retention_days * 86_400
        self._queue: deque[UsageEvent] = deque(maxlen=max_queued)
        self.flush_interval_s = flush_interval_s
        self._task: asyncio.Task[None] | None = None

    def _key(self, tenant_id: str, day: str) -> str:
        return f"{self.prefix}usage:{{{tenant_id}}}:{day}"

    def record(self, event: UsageEvent) -> None:
        """Queue one finished request (never blocks, never raises)."""
        if len(self._queue) == self._queue.maxlen:
            metrics.USAGE_DROPPED.inc()
        self._queue.append(event if event.time else _stamped(event))

    def start(self) -> None:
        """Start the background writer."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="usage-writer")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.flush_interval_s)
            try:
                await self.flush()
            except StoreError as e:
                log.warning("usage records not written yet; retrying", error=str(e))

    async def flush(self) -> int:
        """Write every queued record now (one pipelined round trip); returns how many.
        Raises ``StoreError`` (the records stay queued)."""
        batch = self._queue
        if not batch:
            return 0
        self._queue = deque(maxlen=batch.maxlen)  # records of requests ending meanwhile
        try:
            async with self.client.pipeline(transaction=False) as pipe:
                tenants = {e.tenant_id for e in batch}
                pipe.sadd(f"{self.prefix}usage_tenants", *tenants)
                counts, costs = _totals(batch, self._key)
                for (key, name), value in counts.items():
                    pipe.hincrby(key, name, value)
                for (key, name), cost in costs.items():
                    pipe.hincrbyfloat(key, name, cost)
                for tenant_id, day in {(e.tenant_id, _day(e.time)) for e in batch}:
                    end = datetime.fromisoformat(day).replace(tzinfo=UTC).timestamp() + 86_400
                    pipe.expireat(self._key(tenant_id, day), int(end + self.retention_s))
                await pipe.execute()
        except STORE_FAILURES as exc:
            if not is_store_failure(exc):
                raise
            # back in front of the newer ones (the oldest go first when that overflows)
            newer, self._queue = self._queue, batch
            for e in newer:
                self.record(e)
            raise StoreError(f"redis usage write failed: {type(exc).__name__}: {exc}") from exc
        metrics.USAGE_WRITTEN.inc(len(batch))
        return len(batch)

    async def close(self) -> None:
        """Stop the writer after one last flush (best effort)."""
        await cancel_and_wait(self._task)
        self._task = None
        with contextlib.suppress(StoreError):
            await self.flush()

    async def query(
        self,
        *,
        tenant_id: str = "",
        key_id: str = "",
        model: str = "",
        start: str = "",
        end: str = "",
        today: date | None = None,
    ) -> list[UsageRecord]:
        """Records in the day range (UTC), for one tenant or all (deleted ones too),
        filtered by key and model; sorted by date, tenant, key, model, version.
        Raises ValueError (bad range) or ``StoreError``."""
        days = day_range(start, end, today or datetime.now(UTC).date())
        with store_errors("usage read"):
            if tenant_id:
                tenants = [tenant_id]
            else:
                members = await self.client.smembers(f"{self.prefix}usage_tenants")
                tenants = sorted(str(m) for m in members)
            async with self.client.pipeline(transaction=False) as pipe:
                for t in tenants:
                    for d in days:
                        pipe.hgetall(self._key(t, d))
                rows = await pipe.execute()
        out: list[UsageRecord] = []
        it = iter(rows)
        for t in tenants:
            for d in days:
                out.extend(_records(d, t, next(it), key_id, model))
        return out


def _stamped(e: UsageEvent) -> UsageEvent:
    return replace(e, time=time.time())


def _totals(
    batch: Iterable[UsageEvent], key_of: Callable[[str, str], str]
) -> tuple[dict[tuple[str, str], int], dict[tuple[str, str], float]]:
    """The batch's increments summed per (hash, field): one HINCRBY per counter a batch
    touched, not one per request (``cost_usd`` apart, a float)."""
    counts: dict[tuple[str, str], int] = defaultdict(int)
    costs: dict[tuple[str, str], float] = defaultdict(float)
    days: dict[int, str] = {}  # UTC day number -> its date
    for e in batch:
        n = int(e.time // 86_400)
        day = days.get(n) or days.setdefault(n, _day(e.time))
        key = key_of(e.tenant_id, day)
        # "|" separates the parts of a field name: never inside one
        head = "|".join(x.replace("|", "_") for x in (e.key_id, e.model, e.model_version)) + "|"
        counts[key, head + "requests"] += 1
        for name in COUNTERS[1:]:
            if value := getattr(e, name):
                counts[key, head + name] += value
        if e.cost_usd:
            costs[key, head + "cost_usd"] += e.cost_usd
        if e.status != "OK":
            counts[key, f"{head}errors:{e.status}"] += 1
    return counts, costs


def _records(
    day: str, tenant_id: str, row: dict[str, str], key_id: str, model: str
) -> list[UsageRecord]:
    by: dict[tuple[str, str, str], UsageRecord] = {}
    for name, value in row.items():
        k, m, v, counter = name.split("|", 3)
        if (key_id and k != key_id) or (model and m != model):
            continue
        rec = by.get((k, m, v))
        if rec is None:
            rec = by[(k, m, v)] = UsageRecord(day, tenant_id, k, m, v)
        if counter.startswith("errors:"):
            rec.errors[counter[7:]] = int(value)
        elif counter == "cost_usd":
            rec.cost_usd = float(value)
        elif counter in COUNTERS:
            setattr(rec, counter, int(value))
    return [by[k] for k in sorted(by)]


def to_csv(records: Iterable[UsageRecord]) -> str:
    """CSV with a header row; ``errors`` as ``STATUS=count;...``."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(CSV_COLUMNS)
    for r in records:
        errors = ";".join(f"{k}={v}" for k, v in sorted(r.errors.items()))
        w.writerow(
            [
                r.date,
                r.tenant_id,
                r.key_id,
                r.model,
                r.model_version,
                *(getattr(r, c) for c in COUNTERS),
                f"{r.cost_usd:.9g}",
                errors,
            ]
        )
    return buf.getvalue()


def to_json(records: Iterable[UsageRecord]) -> str:
    """A JSON array of the records."""
    return json.dumps([asdict(r) for r in records])
