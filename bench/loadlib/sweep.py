"""Rate sweep: raise the offered load until p95 TTFT crosses a target; name the knee.

Steps are open-loop Poisson at rising rates (a list, or ``start * factor**i``).
A step *passes* when p95 TTFT <= target and at most ``max_error_share`` of
its requests failed. Rising stops at the first failing step; ``refine``
bisection steps between the last pass and the first failure then narrow the
knee. The *sustainable rate* is the highest passing offered rate.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

from bench.loadlib.runner import Phase, run_phase_sync
from bench.loadlib.workload import TextPool


@dataclasses.dataclass(slots=True)
class SweepConfig:
    """How to raise the load and what counts as too slow."""

    ttft_p95_target_ms: float = 2000.0
    rates: list[float] = dataclasses.field(default_factory=list)
    start: float = 0.5
    factor: float = 2.0
    max_steps: int = 6
    refine: int = 1
    max_error_share: float = 0.05
    pause_s: float = 1.0


def _point(rate: float, report: dict[str, Any], cfg: SweepConfig) -> dict[str, Any]:
    o, eng = report["overall"], report["engine"]
    p95 = o["ttft_ms"].get("p95", math.inf)
    errors = o["num_errors"] / max(o["num_requests"], 1)
    return {
        "offered": rate,
        "request_throughput": o["request_throughput"],
        "output_token_throughput": o["output_token_throughput"],
        "num_requests": o["num_requests"],
        "num_errors": o["num_errors"],
        "errors_by_status": o["errors_by_status"],
        "ttft_ms": o["ttft_ms"],
        "tpot_ms": o["tpot_ms"],
        "e2e_ms": o["e2e_ms"],
        "max_kv_cache_usage": eng.get("max_kv_cache_usage"),
        "max_num_waiting": eng.get("max_num_waiting"),
        "num_preemptions": eng.get("num_preemptions"),
        "passes": bool(p95 <= cfg.ttft_p95_target_ms and errors <= cfg.max_error_share),
    }


def run_sweep(base: Phase, pool: TextPool, cfg: SweepConfig) -> dict[str, Any]:
    """Run the sweep; returns the report (points sorted by offered rate, and the knee)."""
    points: list[dict[str, Any]] = []

    def step(rate: float) -> dict[str, Any]:
        phase = dataclasses.replace(base, run=dataclasses.replace(base.run, rate=rate))
        report, _ = run_phase_sync(phase, pool)
        point = _point(rate, report, cfg)
        points.append(point)
        print(
            f"  offered {rate:7.3f} req/s -> {point['request_throughput']:6.3f} req/s, "
            f"TTFT p95 {point['ttft_ms'].get('p95', float('nan')):8.0f} ms, "
            f"errors {point['num_errors']}, {'pass' if point['passes'] else 'FAIL'}"
        )
        time.sleep(cfg.pause_s)
        return point

    schedule = cfg.rates or [cfg.start * cfg.factor**i for i in range(cfg.max_steps)]
    good: float | None = None
    bad: float | None = None
    for rate in schedule:
        if step(rate)["passes"]:
            good = rate
        else:
            bad = rate
            break
    for _ in range(cfg.refine if bad is not None and good is not None else 0):
        assert good is not None
        assert bad is not None
        mid = round((good + bad) / 2, 3)
        if step(mid)["passes"]:
            good = mid
        else:
            bad = mid
    points.sort(key=lambda p: p["offered"])
    return {
        "config": dataclasses.asdict(cfg),
        "base": {"mix": base.mix, "run": dataclasses.asdict(base.run)},
        "points": points,
        "sustainable_rate": good,
        "first_failing_rate": bad,
        "verdict": _verdict(good, bad, cfg),
    }


def _verdict(good: float | None, bad: float | None, cfg: SweepConfig) -> str:
    target = f"p95 TTFT <= {cfg.ttft_p95_target_ms:.0f} ms"
    if good is None:
        return f"no tested rate met {target}; start the sweep lower"
    if bad is None:
        return f"every tested rate met {target}; the knee lies above {good:g} req/s"
    return f"sustainable rate {good:g} req/s ({target}); {bad:g} req/s crosses the target"
