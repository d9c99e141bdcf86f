"""What the request tests stand on instead of servers: the limiter over a MemoryStore
(with a switch that makes the store fail), real budget ledgers on a real Redis, and a
scripted dispatcher standing for the engine fleet."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from redis.asyncio import Redis

from common.redis_server import free_port
from gateway.domain import Chunk, Deadline, GatewayError
from gateway.fleet.dispatcher import AttemptProgress, EngineJob, TokenStream
from llm.v1 import common_pb2, engine_pb2
from ratelimit.budget.ledger import BudgetLedger
from ratelimit.budget.policy import Budget
from ratelimit.config import LimitPolicy, Tenant
from ratelimit.errors import StoreError
from ratelimit.limiter.algorithm import Outcome
from ratelimit.limiter.decision import Reservation
from ratelimit.limiter.rate_limiter import RateLimiter
from ratelimit.limiter.storage.memory import MemoryStore
from ratelimit.store_guard import StoreGuard
from tests.support.clock import FakeClock

TENANT = Tenant(
    "acme", LimitPolicy(requests_per_minute=600, tokens_per_minute=6000, max_concurrent=4)
)


class FlakyStore(MemoryStore):
    """A MemoryStore whose reserve fails (as a Redis that went away) while ``down``."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__(lease_ttl_ms=30_000, concurrency_retry_ms=500, clock=clock)
        self.down = False

    async def reserve(self, *args: Any, **kwargs: Any) -> Outcome:
        if self.down:
            raise StoreError("connection refused")
        return await super().reserve(*args, **kwargs)


class CountingLimiter(RateLimiter):
    """The real limiter, counting every settle per reservation (settled exactly once?)."""

    def __init__(self, store: MemoryStore, **kwargs: Any) -> None:
        super().__init__(store, **kwargs)
        self.settles: list[tuple[str, int, int]] = []  # (lease id, prompt, completion)

    async def settle(
        self, reservation: Reservation, *, prompt_tokens: int, completion_tokens: int
    ) -> None:
        self.settles.append((reservation.lease_id, prompt_tokens, completion_tokens))
        await super().settle(
            reservation, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens
        )


def limiter(clock: FakeClock | None = None, **kwargs: Any) -> CountingLimiter:
    """A limiter over a fresh FlakyStore (``limiter.store``)."""
    return CountingLimiter(FlakyStore(clock or FakeClock(1_000_000.0)), **kwargs)


class Ledgers:
    """Real budget ledgers (Lua on a real Redis, started once per test module), each
    with its own key prefix and a fake clock; ``down()`` is one whose Redis is gone."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.clients: list[Redis] = []

    def _ledger(self, url: str, clock: FakeClock) -> BudgetLedger:
        client = Redis.from_url(url, decode_responses=True)
        self.clients.append(client)
        prefix = f"t{uuid.uuid4().hex[:10]}:"
        return BudgetLedger(client, StoreGuard(2000), prefix=prefix, clock=clock)

    def up(self, clock: FakeClock) -> BudgetLedger:
        return self._ledger(self.url, clock)

    def down(self) -> BudgetLedger:
        return self._ledger(f"redis://127.0.0.1:{free_port()}", FakeClock(1_700_000_000.0))

    async def close(self) -> None:
        for client in self.clients:
            await client.aclose()


async def used(ledger: BudgetLedger, tenant_id: str, budget: Budget) -> float:
    """What ``budget`` of the tenant has counted so far, read from Redis."""
    (level,) = await ledger.levels(tenant_id, [budget])
    return level.used


async def open_holds(ledger: BudgetLedger, tenant_id: str) -> int:
    """Holds charged and not yet settled (the ledger's hold hash)."""
    return int(await ledger.client.hlen(f"{ledger.prefix}{{{tenant_id}}}:Bh"))


def engine_job(num_prompt: int = 10, max_tokens: int = 100, model: str = "m") -> EngineJob:
    return EngineJob(
        request_id="acme.1",
        traceparent="",
        tenant_id="acme",
        priority=common_pb2.NORMAL,
        model=model,
        model_version="",
        prompt_token_ids=list(range(1, num_prompt + 1)),
        sampling=engine_pb2.EngineSamplingParams(max_tokens=max_tokens),
        deadline=Deadline(30),
        stop_strings=[],
    )


@dataclass
class FakeDispatcher:
    """Stands for the engine fleet: each run makes its engine call (``on_dispatched``),
    then streams ``tokens`` one per chunk, as the script says.

    Attributes:
        refuse: Refuse before the engine answers (as every replica full would).
        fail_after: Fail (UNAVAILABLE) after this many tokens.
        hang_after: Wait, after this many tokens, until the run is closed.
    """

    tokens: tuple[int, ...] = (504, 3575, 282, 4649)
    refuse: GatewayError | None = None
    fail_after: int | None = None
    hang_after: int | None = None
    jobs: list[EngineJob] = field(default_factory=list)
    waiting: asyncio.Event = field(default_factory=asyncio.Event)  # set once it hangs
    closed: int = 0  # runs ended by their caller (the engine call cancelled)

    async def run(
        self,
        job: EngineJob,
        text: TokenStream,
        progress: AttemptProgress,
        on_dispatched: Callable[[], None] | None = None,
    ) -> AsyncGenerator[Chunk, None]:
        self.jobs.append(job)
        progress.attempt_started_at = time.perf_counter()
        progress.model, progress.model_version = job.model, "v1"
        progress.dispatched = True
        if on_dispatched is not None:
            on_dispatched()
        try:
            await asyncio.sleep(0)  # the call's send
            if self.refuse is not None:
                raise self.refuse
            for i, token in enumerate(self.tokens):
                if i == self.fail_after:
                    raise GatewayError(grpc.StatusCode.UNAVAILABLE, "the engine failed")
                if i == self.hang_after:
                    self.waiting.set()
                    await asyncio.Event().wait()
                progress.engine_answered = True
                resp = engine_pb2.EngineGenerateResponse(token_ids=[token])
                if i == len(self.tokens) - 1:
                    resp.finish_reason = common_pb2.LENGTH
                    resp.usage.cached_prompt_tokens = 2
                chunk = text.on_engine_chunk(resp)
                if chunk is not None:
                    yield progress.count(chunk)
        except GeneratorExit:
            self.closed += 1
            raise
        except asyncio.CancelledError:
            self.closed += 1
            raise
