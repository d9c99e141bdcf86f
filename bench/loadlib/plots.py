"""PNG figures of a run, a sweep and the fairness experiments (matplotlib, Agg)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.ticker import NullFormatter

from bench.loadlib.targets import RequestRecord


def _cdf(ax: Any, values_ms: list[float], label: str) -> None:
    if not values_ms:
        return
    xs = sorted(values_ms)
    ys = [(i + 1) / len(xs) for i in range(len(xs))]
    ax.step(xs, ys, where="post", label=f"{label} (n={len(xs)})")


def plot_run(
    records: Sequence[RequestRecord], engine: dict[str, Any], path: Path, title: str
) -> Path:
    """Latency CDFs per tenant (TTFT, TPOT, e2e) and engine queue / KV usage over time."""
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    tenants = sorted({r.tenant for r in records})
    metrics: list[tuple[str, Callable[[RequestRecord], float | None]]] = [
        ("TTFT", lambda r: r.ttft),
        ("TPOT", lambda r: r.tpot),
        ("end-to-end", lambda r: r.e2e),
    ]
    for ax, (name, get) in zip(axes.flat, metrics, strict=False):
        for t in tenants:
            vals = [
                1000 * v for r in records if r.ok and r.tenant == t and (v := get(r)) is not None
            ]
            _cdf(ax, vals, t)
        ax.set(xlabel=f"{name} (ms)", ylabel="fraction of requests", title=f"{name} CDF")
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax = axes[1, 1]
    series = engine.get("series", [])
    for replica in engine.get("replicas", []):
        pts = [s for s in series if s["replica"] == replica]
        ts = [s["t"] for s in pts]
        ax.plot(ts, [100 * s["kv_cache_usage"] for s in pts], label=f"KV % {replica}")
        ax.plot(ts, [s["num_waiting"] for s in pts], "--", label=f"waiting {replica}")
        ax.plot(ts, [s["num_running"] for s in pts], ":", label=f"running {replica}")
    ax.set(xlabel="time (s)", ylabel="KV usage % / requests", title="engine over time")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def plot_sweep(
    points: list[dict[str, Any]],
    target_ms: float,
    knee: float | None,
    path: Path,
    offered_label: str,
) -> Path:
    """Achieved throughput and TTFT percentiles against offered load."""
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    xs = [p["offered"] for p in points]
    a1.plot(xs, [p["request_throughput"] for p in points], "o-", label="achieved req/s")
    if "rate" in offered_label:
        a1.plot(xs, xs, "k:", label="achieved = offered")
    a1b = a1.twinx()
    a1b.plot(
        xs,
        [p["output_token_throughput"] for p in points],
        "s--",
        color="tab:green",
        label="output tok/s",
    )
    a1.set(
        xlabel=offered_label,
        ylabel="requests/s (to the last completion)",
        title="throughput vs offered load",
    )
    a1b.set_ylabel("output tokens/s")
    a1.legend(loc="upper left", fontsize=8)
    a1b.legend(loc="lower right", fontsize=8)
    for pct in ("p50", "p95", "p99"):
        a2.plot(xs, [p["ttft_ms"].get(pct) for p in points], "o-", label=f"TTFT {pct}")
    a2.axhline(target_ms, color="red", ls="--", label=f"target p95 {target_ms:.0f} ms")
    if knee is not None:
        a2.axvline(knee, color="gray", ls=":", label=f"sustainable {knee:g}")
    a2.set(xlabel=offered_label, ylabel="ms", title="TTFT vs offered load", yscale="log")
    a2.legend(fontsize=8)
    for ax in (a1, a2):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def plot_fairness(experiments: list[dict[str, Any]], path: Path) -> Path:
    """Per experiment: the protected metric idle vs loaded, against its allowed ratio."""
    fig, axes = plt.subplots(1, len(experiments), figsize=(5 * len(experiments), 4.5))
    for ax, exp in zip([axes] if len(experiments) == 1 else list(axes), experiments, strict=True):
        bars = exp["bars"]  # label -> ms
        labels = list(bars)
        ax.bar(
            labels,
            [bars[k] for k in labels],
            color=["tab:blue", "tab:orange", "tab:red", "tab:gray"][: len(labels)],
        )
        if exp.get("limit_ms") is not None:
            ax.axhline(exp["limit_ms"], color="red", ls="--", label=exp["limit_label"])
            ax.legend(fontsize=8)
        verdict = "HOLDS" if exp["holds"] else "MISSES"
        ax.set(title=f"({exp['id']}) {verdict}: {exp['metric']}", ylabel="ms")
        ax.tick_params(axis="x", labelsize=8)
        ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def plot_fairness_timeline(exp: dict[str, Any], path: Path) -> Path:
    """The loaded phase of one experiment over time: each request's TTFT by tenant, and
    each tenant's share of the service (the engines' fair-share count) per second."""
    tl = exp["loaded_timeline"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for tenant, points in sorted(tl["ttft_ms"].items()):
        a1.scatter([p[0] for p in points], [p[1] for p in points], s=12, label=tenant)
    a1.set(
        xlabel="request start (s into the phase)",
        ylabel="TTFT (ms)",
        yscale="log",
        title=f"({exp['id']}) TTFT over time",
    )
    tenants = sorted(tl["share"])
    if tl["bins"]:
        a2.stackplot(tl["bins"], [tl["share"][t] for t in tenants], labels=tenants, alpha=0.8)
    a2.set(
        xlabel=f"time (s, {tl['bin_s']:g} s bins)",
        ylabel="share of service (prompt tokens x1, output x2)",
        ylim=(0, 1),
        title=f"({exp['id']}) service share over time",
    )
    for ax in (a1, a2):
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
