"""Engine-side time series: ``GetStats`` of every replica, polled during a run.

Queue length, running batch, KV usage and preemptions are what the client
cannot see; sampling them beside the client timings tells *why* a latency
moved (queueing vs KV pressure vs preemption).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import asdict, dataclass
from typing import Any

import grpc

from common.service_auth import token_metadata
from llm.v1 import engine_pb2, engine_pb2_grpc


@dataclass(slots=True)
class StatsSample:
    """One GetStats answer of one replica."""

    t: float  # seconds since the run started
    replica: str
    num_waiting: int
    num_running: int
    num_kv_blocks_used: int
    num_kv_blocks_total: int
    kv_cache_usage: float
    num_preemptions_total: int
    num_requests_total: int
    generation_tokens_per_second: float


class EngineSampler:
    """Polls ``GetStats`` on each address every ``interval`` seconds until stopped."""

    def __init__(
        self, addresses: list[str], interval: float = 0.25, service_token: str = ""
    ) -> None:
        self.addresses = addresses
        self.metadata = token_metadata(service_token)
        self.interval = interval
        self.samples: list[StatsSample] = []
        self.first: dict[str, StatsSample] = {}
        self.last: dict[str, StatsSample] = {}
        self._channels = [grpc.aio.insecure_channel(a) for a in addresses]
        self._stubs = [engine_pb2_grpc.EngineStub(c) for c in self._channels]
        self._task: asyncio.Task[None] | None = None
        self._t0 = time.perf_counter()

    async def poll_once(self) -> None:
        """One GetStats per replica (a replica that does not answer is skipped)."""
        now = time.perf_counter() - self._t0
        for addr, stub in zip(self.addresses, self._stubs, strict=True):
            try:
                s = await stub.GetStats(
                    engine_pb2.GetStatsRequest(), timeout=2.0, metadata=self.metadata
                )
            except grpc.aio.AioRpcError:
                continue
            sample = StatsSample(
                now,
                addr,
                s.num_waiting,
                s.num_running,
                s.num_kv_blocks_used,
                s.num_kv_blocks_total,
                s.kv_cache_usage,
                s.num_preemptions_total,
                s.num_requests_total,
                s.generation_tokens_per_second,
            )
            self.first.setdefault(addr, sample)
            self.last[addr] = sample
            self.samples.append(sample)

    async def _loop(self) -> None:
        while True:
            await self.poll_once()
            await asyncio.sleep(self.interval)

    async def start(self, t0: float) -> None:
        """Take a first sample (the baseline for deltas), then poll in the background."""
        self._t0 = t0
        await self.poll_once()
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        """Stop polling after one last sample; close the channels."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.poll_once()
        for c in self._channels:
            await c.close(None)

    def delta(self, name: str) -> int:
        """Growth of a counter (``num_preemptions_total``...) over the run, all replicas."""
        return sum(
            int(getattr(self.last[a], name)) - int(getattr(self.first[a], name)) for a in self.first
        )

    def summary(self) -> dict[str, Any]:
        """Peaks, means and counter deltas over the run, plus the raw series."""
        run = [s for s in self.samples if s.t >= 0]
        if not run:
            return {"replicas": self.addresses, "num_samples": 0, "series": []}
        return {
            "replicas": self.addresses,
            "num_samples": len(run),
            "interval_s": self.interval,
            "max_kv_cache_usage": max(s.kv_cache_usage for s in run),
            "mean_kv_cache_usage": sum(s.kv_cache_usage for s in run) / len(run),
            "max_num_waiting": max(s.num_waiting for s in run),
            "mean_num_waiting": sum(s.num_waiting for s in run) / len(run),
            "max_num_running": max(s.num_running for s in run),
            "num_kv_blocks_total": {a: s.num_kv_blocks_total for a, s in self.last.items()},
            "num_preemptions": self.delta("num_preemptions_total"),
            "num_engine_requests": self.delta("num_requests_total"),
            "series": [asdict(s) for s in run],
        }
