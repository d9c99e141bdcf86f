"""Fairness and priority experiments, through the Gateway API.

Each experiment measures a protected tenant alone ("idle"), then beside an
aggressor ("loaded"), on the same services, and compares:

    (a) flood    tenant ``chat`` (short chats, Poisson) vs ``flood`` (long prompts,
                 closed loop), both NORMAL:  chat p95 TTFT loaded <= 2x idle
    (b) priority ``critical`` (CRITICAL, short chats) vs ``low`` (LOW, closed loop
                 past max_num_seqs):         critical p95 TTFT loaded <= 1.5x idle
    (c) limits   ``limited`` (rpm limit, burst 1) sending far above it:
                 p99 of a rejection at most 5 ms above the p99 of a plain
                 authenticated call (ListModels, same pace, right after), and the
                 engines saw only admitted requests (GetStats num_requests_total
                 delta == admitted)

Priorities and limits are the tenants' own (admin API). Nothing here changes
the scheduler or the gateway: a miss is reported with its numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid
from pathlib import Path
from typing import Any

from bench.loadlib import plots
from bench.loadlib.driver import RunConfig
from bench.loadlib.runner import Endpoint, Phase, run_phase_sync
from bench.loadlib.spawn import setup_tenants
from bench.loadlib.stats import dist_ms
from bench.loadlib.targets import GatewayTarget, RequestRecord
from bench.loadlib.workload import Caps, TenantSpec, TextPool


def add_args(p: argparse.ArgumentParser) -> None:
    """Flags of ``python -m bench.load fairness``."""
    p.set_defaults(target="gateway")
    g = p.add_argument_group("experiments")
    g.add_argument("--experiments", default="a,b,c")
    g.add_argument("--phase-duration", type=float, default=20.0, help="seconds per phase")
    g.add_argument("--chat-rate", type=float, default=1.0, help="(a) chat tenant req/s")
    g.add_argument("--flood-concurrency", type=int, default=4, help="(a) flood workers")
    g.add_argument(
        "--flood-max-concurrent",
        type=int,
        default=0,
        help="(a) the flood tenant's max_concurrent limit (0 = none)",
    )
    g.add_argument("--critical-rate", type=float, default=0.5, help="(b) CRITICAL req/s")
    g.add_argument("--low-concurrency", type=int, default=24, help="(b) LOW workers")
    g.add_argument("--limited-rate", type=float, default=5.0, help="(c) offered req/s")
    g.add_argument("--limited-rpm", type=int, default=6, help="(c) the tenant's rpm limit")


def _p(report: dict[str, Any], tenant: str, metric: str = "ttft_ms", pct: str = "p95") -> float:
    return float(report["per_tenant"].get(tenant, {}).get(metric, {}).get(pct, float("nan")))


def _strip(report: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in report.items() if k not in ("per_kind", "config")}


class Runner:
    """Runs phases with shared settings; tenants get ids unique to this run."""

    def __init__(
        self, args: argparse.Namespace, endpoint: Endpoint, admin_key: str, pool: TextPool
    ) -> None:
        self.args, self.endpoint, self.admin_key, self.pool = args, endpoint, admin_key, pool
        self.tag = f"-{uuid.uuid4().hex[:6]}"
        self.caps = Caps(args.max_prompt_tokens, args.max_output_tokens)
        self.last_records: list[RequestRecord] = []  # of the last phase (for timelines)

    def phase(self, tenants: list[TenantSpec], duration: float | None = None) -> dict[str, Any]:
        """One bounded phase with ``tenants``; returns its report."""
        run = RunConfig(
            num_requests=self.args.num_requests,
            duration=duration or self.args.phase_duration,
            drain_timeout=self.args.drain_timeout,
            request_timeout=self.args.request_timeout,
            seed=self.args.seed,
            progress=not self.args.no_progress,
        )
        report, self.last_records = run_phase_sync(
            Phase(self.endpoint, tenants, run, "short_chat", self.caps), self.pool
        )
        time.sleep(1.0)  # let the engines drain what was cancelled
        return report

    def tenants(self, *specs: TenantSpec) -> list[TenantSpec]:
        """Create the tenants (priorities, limits, keys) through the admin API."""
        setup_tenants(
            self.endpoint.address, self.admin_key, list(specs), self.tag, self.endpoint.ca_cert
        )
        return list(specs)


def _ratio_experiment(
    exp_id: str, r: Runner, protected: TenantSpec, aggressor: TenantSpec, limit: float, what: str
) -> dict[str, Any]:
    r.tenants(protected, aggressor)
    idle = r.phase([protected])
    loaded = r.phase([protected, aggressor])
    timeline = timelines(r.last_records)
    base, under = _p(idle, protected.name), _p(loaded, protected.name)
    ratio = under / base if base > 0 else float("nan")
    return {
        "id": exp_id,
        "what": what,
        "metric": f"{protected.name} p95 TTFT",
        "idle_ms": base,
        "loaded_ms": under,
        "ratio": ratio,
        "allowed_ratio": limit,
        "holds": bool(ratio <= limit),
        "aggressor_p95_ttft_ms": _p(loaded, aggressor.name),
        "bars": {
            f"{protected.name} idle": base,
            f"{protected.name} loaded": under,
            f"{aggressor.name} loaded": _p(loaded, aggressor.name),
        },
        "limit_ms": base * limit,
        "limit_label": f"{limit}x idle",
        "idle": _strip(idle),
        "loaded": _strip(loaded),
        "loaded_timeline": timeline,
    }


def exp_flood(r: Runner) -> dict[str, Any]:
    """(a) short chats beside a long-prompt flood, same priority."""
    a = r.args
    chat = TenantSpec("chat", "NORMAL", rate=a.chat_rate, mix="short_chat")
    flood = TenantSpec(
        "flood",
        "NORMAL",
        concurrency=a.flood_concurrency,
        mix="long_context",
        max_concurrent=a.flood_max_concurrent,
    )
    return _ratio_experiment(
        "a", r, chat, flood, 2.0, "short chats' p95 TTFT with a long-prompt flood beside them"
    )


def exp_priority(r: Runner) -> dict[str, Any]:
    """(b) CRITICAL beside a LOW tenant that keeps the engine overloaded."""
    a = r.args
    critical = TenantSpec("critical", "CRITICAL", rate=a.critical_rate, mix="short_chat")
    low = TenantSpec("low", "LOW", concurrency=a.low_concurrency, mix="chatlike")
    return _ratio_experiment(
        "b", r, critical, low, 1.5, "CRITICAL p95 TTFT while LOW overloads the engine"
    )


def exp_limits(r: Runner) -> dict[str, Any]:
    """(c) a rate-limited tenant far above its limit: fast rejections, no engine work."""
    a = r.args
    limited = TenantSpec(
        "limited",
        "NORMAL",
        rate=a.limited_rate,
        mix="short_chat",
        rpm=a.limited_rpm,
        request_burst=1,
    )
    r.tenants(limited)
    rep = r.phase([limited], duration=min(a.phase_duration, 10.0))
    # the baseline: as many authenticated calls that do nothing else, at the same pace,
    # from a client like the load's, right after (a rejection's cost is what it adds)
    plain = dist_ms(asyncio.run(_plain_round_trips(r.endpoint, limited, rep)))
    o = rep["overall"]
    rejected = o["errors_by_status"].get("RESOURCE_EXHAUSTED", 0)
    rej_p99 = float(o["error_latency_ms"].get("p99", float("nan")))
    added_p99 = rej_p99 - float(plain.get("p99", float("nan")))
    engine_seen = rep["engine"].get("num_engine_requests", -1)
    fast = added_p99 <= 5.0
    no_engine_work = engine_seen == o["num_ok"]
    return {
        "id": "c",
        "what": "rate-limited tenant: rejection latency and engine work",
        "metric": "rejection p99 added over a plain authenticated call",
        "num_offered": o["num_requests"],
        "num_admitted": o["num_ok"],
        "num_rejected": rejected,
        "rejection_ms": o["error_latency_ms"],
        "plain_round_trip_ms": plain,
        "added_p99_ms": added_p99,
        "engine_requests_seen": engine_seen,
        "fast_rejections": fast,
        "no_engine_work_for_rejected": no_engine_work,
        "holds": bool(fast and no_engine_work),
        "bars": {
            "rejection p50": float(o["error_latency_ms"].get("p50", float("nan"))),
            "rejection p99": rej_p99,
            "plain call p99": float(plain.get("p99", float("nan"))),
            "added p99": added_p99,
        },
        "limit_ms": 5.0,
        "limit_label": "5 ms (for the added p99)",
        "phase": _strip(rep),
    }


def timelines(records: list[RequestRecord], bin_s: float = 1.0) -> dict[str, Any]:
    """Per tenant over one phase: each request's TTFT at its start time, and the share of
    the service it got per ``bin_s``, counted as the engines' fair share counts it
    (prompt tokens 1 each, at the first token; output tokens 2 each, spread evenly from
    the first token to the end)."""
    ttft: dict[str, list[list[float]]] = {}
    service: dict[str, dict[int, float]] = {}
    for r in records:
        if r.ttft is None:
            continue
        ttft.setdefault(r.tenant, []).append([r.start, r.ttft * 1000.0])
        got = service.setdefault(r.tenant, {})
        first, end = r.start + r.ttft, r.start + max(r.e2e, r.ttft)
        got[int(first // bin_s)] = got.get(int(first // bin_s), 0.0) + r.num_prompt_tokens
        for k in range(r.num_output_tokens):  # token k at its share of the decode time
            at = first + (end - first) * (k / max(1, r.num_output_tokens - 1))
            got[int(at // bin_s)] = got.get(int(at // bin_s), 0.0) + 2.0
    last = max((b for got in service.values() for b in got), default=-1)
    bins = list(range(last + 1))
    totals = [sum(got.get(b, 0.0) for got in service.values()) for b in bins]
    share = {
        t: [got.get(b, 0.0) / tot if tot else 0.0 for b, tot in zip(bins, totals, strict=True)]
        for t, got in sorted(service.items())
    }
    return {"bin_s": bin_s, "bins": [b * bin_s for b in bins], "ttft_ms": ttft, "share": share}


async def _plain_round_trips(
    endpoint: Endpoint, tenant: TenantSpec, rep: dict[str, Any]
) -> list[float]:
    n = max(50, int(rep["overall"]["num_requests"]))
    pause = 1.0 / max(tenant.rate, 1.0)
    target = GatewayTarget(
        endpoint.address, {tenant.name: tenant.key}, endpoint.kind, endpoint.ca_cert
    )
    out = []
    try:
        await target.plain_round_trip(tenant.name)  # the channel is connected
        for _ in range(n):
            t0 = time.perf_counter()
            await target.plain_round_trip(tenant.name)
            out.append(time.perf_counter() - t0)
            await asyncio.sleep(pause)
    finally:
        await target.close()
    return out


EXPERIMENTS = {"a": exp_flood, "b": exp_priority, "c": exp_limits}


def run_all(
    args: argparse.Namespace, endpoint: Endpoint, admin_key: str, pool: TextPool, png: Path
) -> dict[str, Any]:
    """Run the chosen experiments; print verdicts; plot; return the report."""
    if endpoint.kind == "engine" or not admin_key:
        raise SystemExit(
            "fairness runs through the Gateway API with an admin key: "
            "--target gateway|envoy with --spawn or --admin-key(-file)"
        )
    r = Runner(args, endpoint, admin_key, pool)
    results = []
    for exp_id in filter(None, args.experiments.split(",")):
        res = EXPERIMENTS[exp_id](r)
        results.append(res)
        verdict = "HOLDS" if res["holds"] else "MISSES"
        if "ratio" in res:
            print(
                f"({exp_id}) {verdict}: {res['metric']} idle {res['idle_ms']:.0f} ms, "
                f"loaded {res['loaded_ms']:.0f} ms, ratio {res['ratio']:.2f} "
                f"(allowed {res['allowed_ratio']})"
            )
        else:
            print(
                f"({exp_id}) {verdict}: rejection p99 {res['bars']['rejection p99']:.1f} ms, "
                f"a plain authenticated call p99 {res['bars']['plain call p99']:.1f} ms, "
                f"added p99 {res['added_p99_ms']:.1f} ms (allowed 5), "
                f"{res['num_rejected']} rejected / {res['num_admitted']} admitted, "
                f"engines saw {res['engine_requests_seen']}"
            )
    plots.plot_fairness(results, png)
    for res in results:
        if "loaded_timeline" in res:
            plots.plot_fairness_timeline(res, png.with_name(f"{png.stem}_{res['id']}_timeline.png"))
    return {"experiments": results, "target": endpoint.kind, "address": endpoint.address}
