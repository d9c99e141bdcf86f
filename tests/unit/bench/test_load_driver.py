"""bench.loadlib.driver against a fake target: bounds, loops and cancellation (no servers)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
import pytest

from bench.loadlib.driver import RunConfig, run_load, tenant_process
from bench.loadlib.stats import full_summary
from bench.loadlib.targets import CLIENT_CANCELLED, Progress
from bench.loadlib.workload import RequestSpec, TenantSpec


class FakeTarget:
    """Streams ``max_tokens`` one-token chunks, ``delay`` apart; tracks concurrency."""

    name = "fake"

    def __init__(self, delay: float = 0.001, fail_tenant: str = "") -> None:
        self.delay, self.fail_tenant = delay, fail_tenant
        self.active = self.peak = self.calls = 0

    async def stream(self, spec: RequestSpec, timeout_s: float) -> AsyncIterator[Progress]:
        self.calls += 1
        if spec.tenant == self.fail_tenant:
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                grpc.aio.Metadata(),
                grpc.aio.Metadata(),
                "over limit",
                "",
            )
        self.active += 1
        self.peak = max(self.peak, self.active)
        try:
            for _ in range(spec.max_tokens):
                await asyncio.sleep(self.delay)
                yield 1, len(spec.prompt_ids), "v2" if spec.index % 2 else "v1"
        finally:
            self.active -= 1

    async def close(self) -> None:
        return None


def specs(tenant: str, priority: int = 2, max_tokens: int = 3) -> Iterator[RequestSpec]:
    i = 0
    while True:
        yield RequestSpec(i, tenant, priority, "short_chat", "hi", [1, 2, 3], max_tokens)
        i += 1


def test_closed_loop_respects_concurrency_and_count() -> None:
    target = FakeTarget()
    cfg = RunConfig(concurrency=3, num_requests=20, duration=30, progress=False)
    res = asyncio.run(run_load(target, [TenantSpec("t")], {"t": specs("t")}, cfg))
    assert len(res.records) == 20
    assert target.peak == 3
    assert all(r.ok and r.num_output_tokens == 3 and r.ttft is not None for r in res.records)
    assert all(len(r.itl) == 2 for r in res.records)
    assert res.wall_s > 0
    assert {r.version for r in res.records} == {"v1", "v2"}  # as the target reported it
    by_version = full_summary(res.records, res.wall_s)["per_version"]
    assert by_version["v1"]["num_ok"] + by_version["v2"]["num_ok"] == 20


def test_open_loop_is_bounded_by_duration() -> None:
    target = FakeTarget()
    cfg = RunConfig(rate=50.0, num_requests=10_000, duration=0.5, progress=False)
    res = asyncio.run(run_load(target, [TenantSpec("t")], {"t": specs("t")}, cfg))
    assert 5 <= len(res.records) <= 80  # ~25 expected; Poisson, never unbounded
    assert max(r.start for r in res.records) <= 0.6


def test_drain_timeout_cancels_stragglers() -> None:
    target = FakeTarget(delay=0.5)
    cfg = RunConfig(concurrency=2, num_requests=2, duration=0.1, drain_timeout=0.2, progress=False)
    res = asyncio.run(run_load(target, [TenantSpec("t")], {"t": specs("t", max_tokens=50)}, cfg))
    assert [r.status for r in res.records] == [CLIENT_CANCELLED] * 2


def test_tenants_get_their_own_processes_and_errors_are_recorded() -> None:
    target = FakeTarget(fail_tenant="limited")
    tenants = [
        TenantSpec("a", share=3),
        TenantSpec("b", share=1),
        TenantSpec("limited", concurrency=1),
    ]
    cfg = RunConfig(concurrency=4, num_requests=40, duration=5, progress=False, error_backoff=0.01)
    assert tenant_process(tenants[0], cfg, 4.0) == ("concurrency", 3.0)
    assert tenant_process(tenants[2], cfg, 4.0) == ("concurrency", 1.0)
    assert tenant_process(TenantSpec("r", rate=2), cfg, 4.0) == ("rate", 2.0)
    streams = {t.name: specs(t.name) for t in tenants}
    res = asyncio.run(run_load(target, tenants, streams, cfg))
    failed = [r for r in res.records if not r.ok]
    assert failed
    assert {r.tenant for r in failed} == {"limited"}
    assert {r.status for r in failed} == {"RESOURCE_EXHAUSTED"}
    assert {r.tenant for r in res.records} == {"a", "b", "limited"}


def test_the_drain_waits_instead_of_spinning(monkeypatch: pytest.MonkeyPatch) -> None:
    """Once the producers are done, the drain waits on the requests still streaming: a
    finished producer in the wait list made every wait return at once, a busy loop that
    took the CPU the engines on the same machine were serving those requests with."""
    waits = 0
    real_wait = asyncio.wait

    async def counting_wait(*args: Any, **kwargs: Any) -> Any:
        nonlocal waits
        waits += 1
        return await real_wait(*args, **kwargs)

    monkeypatch.setattr("bench.loadlib.driver.asyncio.wait", counting_wait)
    target = FakeTarget(delay=0.2)  # one request streaming for ~0.6 s after the producer ends
    cfg = RunConfig(rate=100.0, num_requests=1, duration=0.05, drain_timeout=5, progress=False)
    res = asyncio.run(run_load(target, [TenantSpec("t")], {"t": specs("t")}, cfg))
    assert [r.ok for r in res.records] == [True]
    assert waits < 50  # a few 0.2 s waits (spinning made thousands)
