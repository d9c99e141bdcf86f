"""Arrival processes and run bounds: open-loop Poisson or closed-loop, per tenant.

Open loop (``rate``): arrivals follow a gamma process (shape = burstiness,
1.0 = Poisson) at the tenant's rate, whatever the server does; a slow server
builds a queue, which is what overload looks like to real users.
Closed loop (``concurrency``): N workers each send the next request when the
previous one ends; offered load falls as latency rises (good for capacity).

A tenant with its own ``rate`` or ``concurrency`` gets its own process;
others split the run's rate or concurrency by ``share``. Every run is bounded
twice: ``num_requests`` issued in total and ``duration`` seconds of issuing;
requests still in flight ``drain_timeout`` seconds later are cancelled.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field

from tqdm import tqdm

from bench.loadlib.targets import RequestRecord, Target, run_one
from bench.loadlib.workload import RequestSpec, TenantSpec


@dataclass(slots=True)
class RunConfig:
    """How hard, how long."""

    rate: float = 0.0  # req/s over all tenants (open loop); 0 = closed loop
    concurrency: int = 4
    burstiness: float = 1.0
    num_requests: int = 200
    duration: float = 30.0
    drain_timeout: float = 30.0
    request_timeout: float = 120.0
    seed: int = 0
    progress: bool = True
    error_backoff: float = 0.1  # closed loop: pause after a failed request (no hot spin)


@dataclass(slots=True)
class _Budget:
    remaining: int
    deadline: float
    closed: bool = False

    def take(self) -> bool:
        if self.closed or self.remaining <= 0 or time.perf_counter() >= self.deadline:
            return False
        self.remaining -= 1
        return True


@dataclass(slots=True)
class LoadResult:
    """Records of every issued request and the run's wall time."""

    records: list[RequestRecord] = field(default_factory=list)
    wall_s: float = 0.0
    t0: float = 0.0


def tenant_process(tenant: TenantSpec, cfg: RunConfig, total_share: float) -> tuple[str, float]:
    """("rate", req/s) or ("concurrency", workers) for one tenant."""
    share = tenant.share / total_share if total_share else 0.0
    if tenant.rate > 0:
        return "rate", tenant.rate
    if tenant.concurrency > 0:
        return "concurrency", float(tenant.concurrency)
    if cfg.rate > 0:
        return "rate", cfg.rate * share
    return "concurrency", float(max(1, round(cfg.concurrency * share)))


class _Run:
    """State of one run: the budget, in-flight tasks, records, the progress bar."""

    def __init__(
        self, target: Target, streams: dict[str, Iterator[RequestSpec]], cfg: RunConfig, t0: float
    ) -> None:
        self.target, self.streams, self.cfg, self.t0 = target, streams, cfg, t0
        self.result = LoadResult(t0=t0)
        self.budget = _Budget(cfg.num_requests, t0 + cfg.duration)
        self.inflight: set[asyncio.Task[bool]] = set()
        self.bar = tqdm(
            total=cfg.num_requests,
            desc=f"load {target.name}",
            unit="req",
            disable=not cfg.progress,
            leave=False,
        )

    async def fire(self, name: str) -> bool:
        spec = next(self.streams[name])
        rec = await run_one(self.target, spec, self.t0, self.cfg.request_timeout)
        self.result.records.append(rec)
        self.bar.update()
        return rec.ok

    async def open_loop(self, name: str, rate: float, rng: random.Random) -> None:
        shape = self.cfg.burstiness
        while True:
            await asyncio.sleep(rng.gammavariate(shape, 1.0 / (rate * shape)))
            if not self.budget.take():
                return
            task = asyncio.create_task(self.fire(name))
            self.inflight.add(task)
            task.add_done_callback(self.inflight.discard)

    async def closed_loop(self, name: str) -> None:
        while self.budget.take():
            if not await self.fire(name):
                await asyncio.sleep(self.cfg.error_backoff)

    def producers(self, tenants: list[TenantSpec]) -> list[asyncio.Task[None]]:
        total_share = sum(t.share for t in tenants if t.rate <= 0 and t.concurrency <= 0)
        tasks: list[asyncio.Task[None]] = []
        for i, tenant in enumerate(tenants):
            kind, value = tenant_process(tenant, self.cfg, total_share)
            if kind == "rate" and value > 0:
                rng = random.Random(self.cfg.seed * 7919 + i)
                tasks.append(asyncio.create_task(self.open_loop(tenant.name, value, rng)))
            elif kind == "concurrency":
                tasks += [
                    asyncio.create_task(self.closed_loop(tenant.name)) for _ in range(int(value))
                ]
        return tasks

    async def wait(self, producers: list[asyncio.Task[None]]) -> None:
        """Until every producer and request is done, or the drain timeout passes."""
        hard_stop = self.budget.deadline + self.cfg.drain_timeout
        while any(not p.done() for p in producers) or self.inflight:
            if time.perf_counter() >= hard_stop:
                break
            # only what is still pending: a finished producer in the list would make
            # every wait return at once (a busy loop taking the engines' CPU in the drain)
            pending = [t for t in (*producers, *self.inflight) if not t.done()]
            if not pending:  # done, its discard callback not run yet
                await asyncio.sleep(0)
                continue
            await asyncio.wait(pending, timeout=0.2, return_when=asyncio.FIRST_COMPLETED)
        self.budget.closed = True
        for t in [*producers, *self.inflight]:
            t.cancel()
        await asyncio.gather(*producers, *list(self.inflight), return_exceptions=True)
        self.bar.close()


async def run_load(
    target: Target,
    tenants: list[TenantSpec],
    streams: dict[str, Iterator[RequestSpec]],
    cfg: RunConfig,
    on_start: Callable[[float], Awaitable[None]] | None = None,
) -> LoadResult:
    """Drive every tenant's arrival process against ``target`` until a bound is hit.

    ``on_start(t0)`` runs first (the engine sampler takes its baseline there).
    """
    t0 = time.perf_counter()
    if on_start is not None:
        await on_start(t0)
    run = _Run(target, streams, cfg, t0)
    await run.wait(run.producers(tenants))
    records = run.result.records
    run.result.wall_s = max((r.start + r.e2e for r in records), default=0.0)
    return run.result
