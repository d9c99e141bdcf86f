"""The figure of ``bench.gateway_bench``'s report (bench/reports/gateway_bench.png)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

SIDE_LABELS = {
    "engine": "engine",
    "floor": "bare grpc.aio relay",
    "work": "relay + encode/detokenize",
    "gateway": "gateway gRPC",
    "http": "gateway HTTP (aiohttp client)",
    "openai": "gateway HTTP (openai client)",
    "curl": "gateway HTTP (curl)",
    "smg": "SMG HTTP (aiohttp client)",
    "smg-tenant": "SMG HTTP, tenant key + limits",
}


def _paired_rows(paired: dict[str, Any]) -> dict[str, dict[str, float]]:
    """The per-pair differences the paired panel shows: over the bare relay where it
    ran, else every side over the engine; each HTTP client over the gRPC front."""
    if "floor_minus_engine_ttft" in paired:
        rows = {
            "gateway - engine\n(first token)": paired["gateway_minus_engine_ttft"]["gateway"],
            "bare relay - engine\n(first token)": paired["floor_minus_engine_ttft"]["floor"],
            "gateway - bare relay\n(first token)": paired["gateway_minus_floor_ttft"]["gateway"],
        }
        if "work_minus_floor_ttft" in paired:
            rows["relay + encode/detok\n- bare relay"] = paired["work_minus_floor_ttft"]["work"]
    else:
        rows = {
            f"{side} - engine\n(first token)": d for side, d in paired["minus_engine_ttft"].items()
        }
    return {
        **rows,
        **{
            f"{side} - gRPC front\n(first text)": d
            for side, d in paired["front_minus_grpc_first_text"].items()
            if side != "gateway"
        },
    }


def _cpu_label(d: dict[str, float]) -> str:
    """A headline bar's CPU per request: net of the proxy's background where recorded."""
    net = d.get("net_cpu_ms_per_request", math.nan)
    if math.isnan(net):
        return f"{d['cpu_ms_per_request']:.1f} cpu-ms"
    return f"{net:.1f} net cpu-ms"


def _headline_panel(ax: Any, head: dict[str, dict[str, dict[str, float]]]) -> None:
    """What each side adds to TTFT p50 over the engine at each concurrency, each bar
    labelled with the CPU ms per request of the process in front of the engine (net of
    its background where recorded)."""
    fronts = [s for s in head["c1"] if s != "engine"]
    xs = range(len(fronts))
    for i, conc in enumerate(head):
        rows = [head[conc][s] for s in fronts]
        bars = ax.bar(
            [x + (i - 0.5) * 0.4 for x in xs],
            [d["added_ttft_p50_ms"] for d in rows],
            0.4,
            label=f"concurrency {conc[1:]}",
        )
        ax.bar_label(bars, [_cpu_label(d) for d in rows], fontsize=6)
    ax.axhline(0, color="black", linewidth=0.5)
    ax.set_xticks(list(xs), [SIDE_LABELS.get(s, s) for s in fronts], fontsize=7, rotation=20)
    ax.set_ylabel("TTFT p50 added over the engine, ms")
    ax.set_title("added TTFT p50 (median of per-round differences)")
    ax.legend(fontsize=7)


def _paired_panel(ax: Any, paired: dict[str, Any]) -> None:
    rows = _paired_rows(paired)
    xs = range(len(rows))
    for i, q in enumerate(("p50_ms", "p90_ms", "p99_ms")):
        ax.bar(
            [x + (i - 1) * 0.25 for x in xs],
            [d[q] for d in rows.values()],
            0.25,
            label=q.replace("_ms", ""),
        )
    ax.axhline(0, color="black", linewidth=0.5)
    ax.set_xticks(list(xs), list(rows), fontsize=7, rotation=25, ha="right")
    ax.set_ylabel("ms added")
    ax.set_title(f"concurrency 1, {paired['pairs']} paired requests")
    ax.legend()


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = ["first_text_p50_ms", "first_text_p99_ms", "event_gap_p50_ms", "event_gap_p99_ms"]
    paired = report["results"].get("c1_paired")
    head = report.get("headline")
    panels = 2 + bool(head) + bool(paired)
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4))
    if head:
        _headline_panel(axes[2], head)
    if paired:
        _paired_panel(axes[-1], paired)
    sides = list(report["results"]["c1"]["by_round"])
    width = 0.8 / len(sides)
    for ax, conc in zip(axes, ("c1", "c32"), strict=False):
        res = report["results"][conc]
        xs = range(len(metrics))
        for i, side in enumerate(sides):
            ax.bar(
                [x + (i - (len(sides) - 1) / 2) * width for x in xs],
                [res[side][m] for m in metrics],
                width,
                label=SIDE_LABELS.get(side, side),
            )
        ax.set_xticks(list(xs), [m.replace("_ms", "") for m in metrics])
        ax.set_ylabel("ms")
        ax.set_title(f"concurrency {conc[1:]} (median of {report['rounds']} rounds)")
        ax.legend(fontsize=7)
    m = report.get("machine", {})
    placement = report.get("placement")
    where = (
        f"engine on CPU {placement['engine_cpus']}, proxies on "
        f"{placement['proxy_cpus']}, the rest on "
        f"{placement['others_cpus']}"
        if isinstance(placement, dict)
        else "every process on every core"
    )
    fig.suptitle(
        f"Gateway added latency, {report.get('engine', 'model')} engine: "
        f"{m.get('cpu', '?')}, {m.get('cores', '?')} cores, {where}, "
        f"{report.get('gateway_workers', 1)} gateway worker(s), "
        f"{report.get('connections_c32', 1)} connection(s) at 32, "
        f"load {m.get('loadavg_at_save', [math.nan])[0]:.1f}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
