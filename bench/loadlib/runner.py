"""One load phase end to end: request streams, target, engine sampler, summary.

``run_phase`` is what ``bench/load.py``, the sweep and the fairness
experiments all call, so every figure in every report is computed one way.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from bench.loadlib.driver import RunConfig, run_load, tenant_process
from bench.loadlib.sampler import EngineSampler
from bench.loadlib.stats import Slo, full_summary
from bench.loadlib.targets import EngineTarget, GatewayTarget, RequestRecord, Target
from bench.loadlib.workload import Caps, TenantSpec, TextPool, tenant_requests


@dataclass(slots=True)
class Endpoint:
    """Where to send and where to sample.

    Attributes:
        kind: ``engine``, ``gateway`` or ``envoy``.
        address: host:port of the target.
        stats: engine replicas to poll with GetStats (may be empty).
        service_token: the internal-call secret engines require (``make run``'s
            ``.run/service.token``); "" for engines without one.
        ca_cert: the CA (PEM) to trust over TLS, for Envoy's listener (``make run``'s
            ``.run/tls/ca.crt``); None = plaintext (the gateway on loopback).
    """

    kind: str
    address: str
    stats: list[str] = field(default_factory=list)
    service_token: str = ""
    ca_cert: bytes | None = None

    def target(self, tenants: list[TenantSpec]) -> Target:
        """A fresh client for this endpoint (keys from the tenants on Gateway APIs)."""
        if self.kind == "engine":
            return EngineTarget(self.address, self.service_token)
        keys = {t.name: t.key for t in tenants}
        return GatewayTarget(self.address, keys, self.kind, self.ca_cert)


@dataclass(slots=True)
class Phase:
    """Everything one load phase needs."""

    endpoint: Endpoint
    tenants: list[TenantSpec]
    run: RunConfig
    mix: str = "chatlike"
    caps: Caps = field(default_factory=Caps)
    slo: Slo = field(default_factory=Slo)
    stats_interval: float = 0.25


def describe(phase: Phase) -> dict[str, Any]:
    """The phase's settings, for the report's ``config`` section."""
    total_share = sum(t.share for t in phase.tenants if t.rate <= 0 and t.concurrency <= 0)
    tenants = []
    for t in phase.tenants:
        kind, value = tenant_process(t, phase.run, total_share)
        d = {k: v for k, v in asdict(t).items() if k != "key"}
        tenants.append({**d, "mix": t.mix or phase.mix, "process": kind, "offered": value})
    return {
        "target": phase.endpoint.kind,
        "address": phase.endpoint.address,
        "stats_replicas": phase.endpoint.stats,
        "mix": phase.mix,
        "caps": asdict(phase.caps),
        "run": asdict(phase.run),
        "tenants": tenants,
        "slo": asdict(phase.slo),
    }


async def run_phase(phase: Phase, pool: TextPool) -> tuple[dict[str, Any], list[RequestRecord]]:
    """Run one phase; returns (report section, raw records)."""
    streams = {
        t.name: tenant_requests(t, phase.mix, pool, phase.run.seed, phase.caps)
        for t in phase.tenants
    }
    target = phase.endpoint.target(phase.tenants)
    sampler = EngineSampler(
        phase.endpoint.stats, phase.stats_interval, phase.endpoint.service_token
    )
    started = time.time()
    try:
        result = await run_load(target, phase.tenants, streams, phase.run, sampler.start)
    finally:
        await sampler.stop()
        await target.close()
    report = {
        "config": describe(phase),
        "started_at": started,
        **full_summary(result.records, result.wall_s, phase.slo),
        "engine": sampler.summary(),
    }
    return report, result.records


def run_phase_sync(phase: Phase, pool: TextPool) -> tuple[dict[str, Any], list[RequestRecord]]:
    """``run_phase`` in a fresh event loop."""
    return asyncio.run(run_phase(phase, pool))
