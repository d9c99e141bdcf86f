"""The figures of ``bench.gateway_bench``: quantiles of one run's samples, the median
over rounds of each round's difference, and quantiles of per-pair differences (all
with the benches' one percentile, ``bench.loadlib.stats.percentile``)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from bench.gatewaylib.sides import Sample
from bench.loadlib.stats import percentile


def per_rank_ms(values_ms: Sequence[float]) -> float:
    """The least-squares slope of ``values_ms`` sorted against their rank (ms per place;
    NaN for fewer than two). Over the TTFTs of one burst (concurrency 32, one request
    per slot) it is how much later each further request's first token comes than the
    one before it: the serial cost per request of whatever the burst queues behind,
    a proxy that takes calls one at a time above all."""
    if len(values_ms) < 2:
        return math.nan
    ranks = [float(i) for i in range(len(values_ms))]
    return statistics.linear_regression(ranks, sorted(values_ms)).slope


def summarize(samples: list[Sample], proxy_cpu_s: float = math.nan) -> dict[str, float]:
    """Quantiles of one run's samples (ms), the TTFTs' slope by rank (``per_rank_ms``)
    and the proxy's CPU ms per request in it (``proxy_cpu_s``: what the process in
    front of the engine used during the run)."""
    ttft = [s[0] * 1000 for s in samples]
    itl = [s[1] * 1000 for s in samples]
    event = [s[2] * 1000 for s in samples]
    first_text = [s[3] * 1000 for s in samples]
    if any(math.isnan(x) for x in itl):  # curl: no gaps
        itl = event = [math.nan]
    return {
        "ttft_p50_ms": percentile(ttft, 50),
        "ttft_p99_ms": percentile(ttft, 99),
        "itl_p50_ms": percentile(itl, 50),
        "itl_p99_ms": percentile(itl, 99),
        "event_gap_p50_ms": percentile(event, 50),
        "event_gap_p99_ms": percentile(event, 99),
        "first_text_p50_ms": percentile(first_text, 50),
        "first_text_p99_ms": percentile(first_text, 99),
        "ttft_per_rank_ms": per_rank_ms(first_text),
        "proxy_cpu_ms_per_request": proxy_cpu_s / max(1, len(samples)) * 1000,
    }


def round_differences(
    side: list[dict[str, float]], base: list[dict[str, float]], keys: Sequence[str] = ()
) -> dict[str, float]:
    """Median over rounds of ``side`` minus ``base`` in each figure (``keys``, or all of
    ``base``'s). The sides of one round run back to back, so a round's difference meets
    one machine state; at concurrency 32 a side's TTFT moves by whole engine steps from
    round to round, which a difference of medians taken over all rounds would keep."""
    return {
        m: statistics.median(a[m] - b[m] for a, b in zip(side, base, strict=True))
        for m in (keys or base[0])
    }


def paired_differences(
    samples: dict[str, list[Sample]], base: str, field: int
) -> dict[str, dict[str, float]]:
    """p1/p10/p50/p90/p99 (ms) of each side's per-pair difference from ``base`` in one
    field of the samples (0 = time to the first token, 3 = to the first text event).
    Tails as long on the low side as on the high one are the machine's noise (the
    engine's next step starting before one side of a pair and after the other), not
    the front's cost."""
    out = {}
    for side, rows in samples.items():
        if side == base:
            continue
        diffs = [(a[field] - b[field]) * 1000 for a, b in zip(rows, samples[base], strict=True)]
        out[side] = {
            "p1_ms": percentile(diffs, 1),
            "p10_ms": percentile(diffs, 10),
            "p50_ms": percentile(diffs, 50),
            "p90_ms": percentile(diffs, 90),
            "p99_ms": percentile(diffs, 99),
        }
    return out


def net_cpu_ms(side: list[dict[str, float]], base: list[dict[str, float]], proxy: str) -> float:
    """CPU ms per request ``proxy`` spent on ``side``'s requests, net of its background:
    per round, its CPU during the side's run less its rate during ``base``'s run (the
    engine side, which no proxy serves: health and stats polls) times the side's run
    time, per request; the median over rounds. Rows carry ``<proxy>_cpu_s``, ``run_s``
    and ``requests``; NaN where they do not."""
    key = f"{proxy}_cpu_s"
    nets = [
        (a[key] - b[key] / b["run_s"] * a["run_s"]) / a["requests"] * 1000
        for a, b in zip(side, base, strict=True)
        if key in a and key in b and b["run_s"] > 0 and a["requests"]
    ]
    return statistics.median(nets) if nets else math.nan
