"""The report of ``bench.gateway_bench``: its JSON (with the run's settings, the CPU
placement and the machine) and the summary it prints."""

from __future__ import annotations

import argparse
import json
import platform
from typing import Any

from bench.gatewaylib.placement import CpuSplit
from bench.gatewaylib.sides import SIDES
from bench.gatewaylib.stack import BENCH_LIMITS


def build_report(
    args: argparse.Namespace,
    split: CpuSplit | None,
    prompt_tokens: int,
    loadavg_before: tuple[float, float, float],
    results: dict[str, Any],
) -> dict[str, Any]:
    """The report of one run: its settings, the CPU placement, the machine, ``results``."""
    return {
        "benchmark": "gateway_bench",
        "rounds": args.rounds,
        "max_tokens": args.max_tokens,
        "tenant_limits": "none" if args.unlimited_tenant else str(BENCH_LIMITS).strip(),
        "prompt_tokens": prompt_tokens,
        "requests": {"c1": args.requests_c1, "c32": args.requests_c32},
        "machine": {"python": platform.python_version(), "loadavg_before": loadavg_before},
        "engine_dtype": args.engine_dtype,
        "engine": args.engine,
        "gateway_workers": args.gateway_workers,
        "connections_c32": args.connections,
        "stub_first_token_ms": args.stub_first_token_ms if args.engine == "stub" else None,
        "placement": (
            {
                "engine_cpus": sorted(split.engine or split.rest),
                "proxy_cpus": sorted(split.proxy or split.rest),
                "others_cpus": sorted(split.rest),
            }
            if split
            else "every process on every core"
        ),
        "note": "all services and the client on one machine (see placement and "
        "machine); figures are noisy. added = gateway (gRPC) - engine (per token); "
        "http_vs_grpc and openai_vs_grpc = HTTP front (aiohttp / openai client) - gRPC front, "
        "time to the first text-bearing event and the gap between such events; "
        "each is the median over rounds of that round's difference (an SSE client "
        "sees text events only; the incremental detokenizer holds back tokens that "
        "complete no character).",
        "results": results,
    }


def print_summary(results: dict[str, Any]) -> None:
    """Each concurrency's medians, proxy CPU and gateway stages, then the paired figures."""
    for conc in ("c1", "c32"):
        res = {k: d for k, d in results[conc].items() if k not in ("gateway_stages", "by_round")}
        print(conc, json.dumps({k: {m: round(v, 2) for m, v in d.items()} for k, d in res.items()}))
        cpu = {s: results[conc][s]["proxy_cpu_ms_per_request"] for s in SIDES}
        print(
            f"  {conc} proxy CPU ms per request (floor: the bare relay's; engine: the "
            "gateway's background): " + "  ".join(f"{s} {v:.2f}" for s, v in cpu.items())
        )
        print(f"  {conc} gateway stages (its own histograms; ms):")
        for label, d in results[conc]["gateway_stages"].items():
            print(
                f"    {label:<34} n={d['count']:<5.0f} mean {d['mean_ms']:7.2f}  "
                f"p50 {d['p50_ms']:7.2f}  p99 {d['p99_ms']:7.2f}"
            )
    if "c1_paired" in results:
        p = results["c1_paired"]
        print(f"c1 paired ({p['pairs']} pairs), per-pair differences in ms:")
        for name, diffs in (
            ("gateway gRPC - engine, first token", p["gateway_minus_engine_ttft"]),
            ("bare relay (floor) - engine, first token", p["floor_minus_engine_ttft"]),
            ("gateway gRPC - bare relay (floor), first token", p["gateway_minus_floor_ttft"]),
            ("HTTP front - gRPC front, first text event", p["front_minus_grpc_first_text"]),
        ):
            for side, d in diffs.items():
                print(
                    f"  {name} [{side}]: p1 {d['p1_ms']:.2f}  p10 {d['p10_ms']:.2f}  "
                    f"p50 {d['p50_ms']:.2f}  p90 {d['p90_ms']:.2f}  p99 {d['p99_ms']:.2f}"
                )
        print(
            "  proxy CPU ms per request: "
            + "  ".join(f"{s} {v:.2f}" for s, v in p["proxy_cpu_ms_per_request"].items())
        )
