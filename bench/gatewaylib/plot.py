"""The figure of ``bench.gateway_bench``'s report (bench/reports/gateway_bench.png)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = ["first_text_p50_ms", "first_text_p99_ms", "event_gap_p50_ms", "event_gap_p99_ms"]
    paired = report["results"].get("c1_paired")
    fig, axes = plt.subplots(1, 3 if paired else 2, figsize=(16 if paired else 11, 4))
    if paired:
        ax = axes[-1]
        rows = {
            "gateway - engine\n(first token)": paired["gateway_minus_engine_ttft"]["gateway"],
            "bare relay - engine\n(first token)": paired["floor_minus_engine_ttft"]["floor"],
            "gateway - bare relay\n(first token)": paired["gateway_minus_floor_ttft"]["gateway"],
            **{
                f"{side} - gRPC front\n(first text)": d
                for side, d in paired["front_minus_grpc_first_text"].items()
                if side != "gateway"
            },
        }
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
    for ax, conc in zip(axes, ("c1", "c32"), strict=False):
        res = report["results"][conc]
        xs = range(len(metrics))
        for i, (side, label) in enumerate(
            (
                ("engine", "engine"),
                ("floor", "bare grpc.aio relay"),
                ("gateway", "gateway gRPC"),
                ("http", "gateway HTTP (aiohttp client)"),
                ("openai", "gateway HTTP (openai client)"),
            )
        ):
            ax.bar(
                [x + (i - 2) * 0.16 for x in xs], [res[side][m] for m in metrics], 0.16, label=label
            )
        ax.set_xticks(list(xs), [m.replace("_ms", "") for m in metrics])
        ax.set_ylabel("ms")
        ax.set_title(f"concurrency {conc[1:]} (median of {report['rounds']} rounds)")
        ax.legend()
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
