"""The gateway's own view in ``bench.gateway_bench``: its stage histograms
(``gateway_stage_seconds``: auth, reserve, reserve_overlap, encode, route, take; the
overhead before the engine attempt; its TTFT and time per output token), scraped from
its /metrics before and after each run, as count, mean and interpolated p50 / p99 of
what that run added."""

from __future__ import annotations

import math

# the gateway's histograms of its own time, by what the report calls them
STAGE_SERIES = {
    **{
        stage: ("gateway_stage_seconds", {"stage": stage})
        for stage in ("auth", "reserve", "reserve_overlap", "encode", "route", "take")
    },
    "overhead (to the engine attempt)": ("gateway_overhead_seconds", {}),
    "ttft (gateway's view)": ("gateway_time_to_first_token_seconds", {}),
    "time per output token": ("gateway_time_per_output_token_seconds", {}),
}
Histo = tuple[float, float, dict[float, float]]  # count, sum, cumulative bucket counts


def scrape_histograms(metrics_url: str) -> dict[str, Histo]:
    """The STAGE_SERIES histograms on a /metrics page, summed over their other labels."""
    import urllib.request

    with urllib.request.urlopen(metrics_url, timeout=10) as resp:
        return parse_histograms(resp.read().decode())


def parse_histograms(text: str) -> dict[str, Histo]:
    """The STAGE_SERIES histograms in a Prometheus text page, summed over their other
    labels (a series the page lacks counts nothing)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, Histo] = {}
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for label, (name, match) in STAGE_SERIES.items():
        count = total = 0.0
        buckets: dict[float, float] = {}
        fam = families.get(name)
        for smp in fam.samples if fam is not None else ():
            if any(smp.labels.get(k) != v for k, v in match.items()):
                continue
            if smp.name.endswith("_count"):
                count += smp.value
            elif smp.name.endswith("_sum"):
                total += smp.value
            elif smp.name.endswith("_bucket"):
                le = float(smp.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + smp.value
        out[label] = (count, total, buckets)
    return out


def histogram_quantile(q: float, buckets: dict[float, float]) -> float:
    """Prometheus' histogram_quantile over cumulative buckets (linear in a bucket)."""
    edges = sorted(buckets)
    if not edges or buckets[edges[-1]] <= 0:
        return math.nan
    rank = q * buckets[edges[-1]]
    lower, below = 0.0, 0.0
    for le in edges:
        if buckets[le] >= rank:
            if math.isinf(le):
                return lower
            width = buckets[le] - below
            return lower + (le - lower) * ((rank - below) / width if width else 0.0)
        lower, below = le, buckets[le]
    return lower


def add_delta(
    acc: dict[str, Histo], before: dict[str, Histo], after: dict[str, Histo]
) -> dict[str, Histo]:
    """``acc`` plus what the histograms gained between two scrapes."""
    out = {}
    for label, (count, total, buckets) in after.items():
        c0, t0, b0 = before.get(label, (0.0, 0.0, {}))
        a_count, a_total, a_buckets = acc.get(label, (0.0, 0.0, {}))
        out[label] = (
            a_count + count - c0,
            a_total + total - t0,
            {le: a_buckets.get(le, 0.0) + v - b0.get(le, 0.0) for le, v in buckets.items()},
        )
    return out


def stage_figures(histos: dict[str, Histo]) -> dict[str, dict[str, float]]:
    """Count, mean, p50 and p99 (ms) of each histogram."""
    return {
        label: {
            "count": n,
            "mean_ms": total / n * 1000 if n else math.nan,
            "p50_ms": histogram_quantile(0.5, buckets) * 1000,
            "p99_ms": histogram_quantile(0.99, buckets) * 1000,
        }
        for label, (n, total, buckets) in histos.items()
    }
