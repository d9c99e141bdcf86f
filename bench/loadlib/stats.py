"""Turn request records into the report's numbers.

Percentiles interpolate linearly between order statistics (numpy's default).
Latencies are reported in milliseconds. Throughput divides by the run's wall
time (first send -> last completion), as serving benchmarks do. *Goodput*
counts requests that succeeded inside every SLO given (TTFT, TPOT).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from bench.loadlib.targets import RequestRecord
from bench.loadlib.workload import PRIORITIES

PRIORITY_NAMES = {v: k for k, v in PRIORITIES.items()}
PCTS = (50, 95, 99)


@dataclass(slots=True)
class Slo:
    """Latency objectives in milliseconds (0 = none)."""

    ttft_ms: float = 0.0
    tpot_ms: float = 0.0

    def met(self, rec: RequestRecord) -> bool:
        """The request succeeded and met every objective set."""
        if not rec.ok or rec.ttft is None:
            return False
        if self.ttft_ms and rec.ttft * 1000 > self.ttft_ms:
            return False
        tpot = rec.tpot
        return not (self.tpot_ms and tpot is not None and tpot * 1000 > self.tpot_ms)


def percentile(values: Sequence[float], pct: float) -> float:
    """The ``pct``-th percentile (0-100) with linear interpolation between the order
    statistics (numpy's default); nan when empty. Every bench's percentiles are this one."""
    if not values:
        return float("nan")
    xs = sorted(values)
    pos = (len(xs) - 1) * pct / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def dist_ms(values_s: Iterable[float]) -> dict[str, float]:
    """mean / p50 / p95 / p99 / max in ms of values given in seconds."""
    xs = [v * 1000.0 for v in values_s]
    if not xs:
        return {"n": 0}
    out: dict[str, float] = {"n": len(xs), "mean": sum(xs) / len(xs)}
    out.update({f"p{p}": percentile(xs, p) for p in PCTS})
    out["max"] = max(xs)
    return out


def summarize(
    records: Sequence[RequestRecord], wall_s: float, slo: Slo | None = None
) -> dict[str, Any]:
    """Counts, throughput, latency distributions and errors of ``records``."""
    ok = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    wall = max(wall_s, 1e-9)
    num_out = sum(r.num_output_tokens for r in ok)
    num_in = sum(r.num_prompt_tokens for r in ok)
    out: dict[str, Any] = {
        "num_requests": len(records),
        "num_ok": len(ok),
        "num_errors": len(failed),
        "duration_s": wall_s,
        "total_prompt_tokens": num_in,
        "total_output_tokens": num_out,
        "request_throughput": len(ok) / wall,
        "output_token_throughput": num_out / wall,
        "total_token_throughput": (num_in + num_out) / wall,
        "ttft_ms": dist_ms(r.ttft for r in ok if r.ttft is not None),
        "tpot_ms": dist_ms(t for r in ok if (t := r.tpot) is not None),
        "itl_ms": dist_ms(x for r in ok for x in r.itl),
        "e2e_ms": dist_ms(r.e2e for r in ok),
        "errors_by_status": dict(Counter(r.status for r in failed)),
        "error_latency_ms": dist_ms(r.e2e for r in failed),
        "error_examples": {r.status: r.error for r in failed},
    }
    if slo is not None and (slo.ttft_ms or slo.tpot_ms):
        good = sum(1 for r in records if slo.met(r))
        out["slo"] = {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms}
        out["goodput_req_s"] = good / wall
        out["slo_attainment"] = good / len(records) if records else float("nan")
    return out


def breakdown(
    records: Sequence[RequestRecord],
    wall_s: float,
    key: Callable[[RequestRecord], str],
    slo: Slo | None = None,
) -> dict[str, dict[str, Any]]:
    """``summarize`` per group of ``key``."""
    groups: dict[str, list[RequestRecord]] = {}
    for r in records:
        groups.setdefault(key(r), []).append(r)
    return {k: summarize(v, wall_s, slo) for k, v in sorted(groups.items())}


def full_summary(
    records: Sequence[RequestRecord], wall_s: float, slo: Slo | None = None
) -> dict[str, Any]:
    """Overall, per-tenant, per-priority, per-workload-kind and per-model-version summaries.

    ``per_version`` puts a canary's TTFT/TPOT/error rate beside the stable
    version's (requests refused before any version was chosen count as "-").
    """
    return {
        "overall": summarize(records, wall_s, slo),
        "per_tenant": breakdown(records, wall_s, lambda r: r.tenant, slo),
        "per_priority": breakdown(
            records, wall_s, lambda r: PRIORITY_NAMES.get(r.priority, str(r.priority)), slo
        ),
        "per_kind": breakdown(records, wall_s, lambda r: r.kind, slo),
        "per_version": breakdown(records, wall_s, lambda r: r.version or "-", slo),
    }


def format_table(summary: dict[str, Any], title: str) -> str:
    """A benchmark_serving-style text block for one summary."""

    def row(label: str, value: Any) -> str:
        text = f"{value:.2f}" if isinstance(value, float) else str(value)
        return f"{label:<40}{text:>12}"

    lines = [
        f"{' ' + title + ' ':=^52}",
        row("Successful requests", summary["num_ok"]),
        row("Failed requests", summary["num_errors"]),
        row("Duration (s)", summary["duration_s"]),
        row("Request throughput (req/s)", summary["request_throughput"]),
        row("Output token throughput (tok/s)", summary["output_token_throughput"]),
        row("Total token throughput (tok/s)", summary["total_token_throughput"]),
    ]
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        d = summary[name]
        if d.get("n"):
            lines.append(
                row(
                    f"{name[:-3].upper()} p50 / p95 / p99 (ms)",
                    f"{d['p50']:.0f} / {d['p95']:.0f} / {d['p99']:.0f}",
                )
            )
    if summary["errors_by_status"]:
        lines.append(
            row("Errors", ", ".join(f"{k}={v}" for k, v in summary["errors_by_status"].items()))
        )
    if "goodput_req_s" in summary:
        lines.append(row("Goodput (req/s within SLO)", summary["goodput_req_s"]))
    return "\n".join(lines)
