"""The report of ``bench.gateway_bench``: its JSON (with the run's settings, the CPU
placement and the machine), the headline table (per concurrency and side: TTFT p50,
what the side adds over the engine, the CPU per request of the process in front of
the engine) and the summary it prints."""

from __future__ import annotations

import argparse
import json
import math
import platform
from collections.abc import Mapping
from typing import Any

from bench.gatewaylib.limits import BENCH_LIMITS
from bench.gatewaylib.placement import CpuSplit
from common import eager_send

# not sides: what measure() derives from them, per concurrency
DERIVED = ("gateway_stages", "by_round", "added_vs_engine", "net_cpu_ms_per_request")


def sides_of(results: dict[str, Any]) -> list[str]:
    """The sides a run measured, in its order."""
    return list(results["c1"]["by_round"])


def headline(results: dict[str, Any]) -> dict[str, dict[str, dict[str, float]]]:
    """Per concurrency and side: the median TTFT p50 (ms; an HTTP side's first text
    event), what the side adds to it over the engine (the median over rounds of that
    round's difference; 0 for the engine) and the CPU ms per request of the process in
    front of the engine during that side's runs: all of it, and net of that process's
    background (its rate during the engine side's runs; NaN where not recorded); at
    concurrency 32 also the TTFTs' slope by rank (``stats.per_rank_ms``, the median
    over rounds: how much later each further request of the burst gets its first
    token; NaN at 1, where the requests do not queue)."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for conc in ("c1", "c32"):
        res = results[conc]
        added = res.get("added_vs_engine", {})
        net = res.get("net_cpu_ms_per_request", {})
        out[conc] = {
            side: {
                "ttft_p50_ms": res[side]["ttft_p50_ms"],
                "added_ttft_p50_ms": (
                    0.0 if side == "engine" else added.get(side, {}).get("ttft_p50_ms", math.nan)
                ),
                "cpu_ms_per_request": res[side]["proxy_cpu_ms_per_request"],
                "net_cpu_ms_per_request": 0.0 if side == "engine" else net.get(side, math.nan),
                "ttft_per_rank_ms": (
                    res[side].get("ttft_per_rank_ms", math.nan) if conc == "c32" else math.nan
                ),
            }
            for side in sides_of(results)
        }
    return out


def headline_table(head: dict[str, dict[str, dict[str, float]]], cpu_of: Mapping[str, str]) -> str:
    """``headline`` as a text table; ``cpu_of`` names whose CPU each side's is."""
    lines = [
        f"{'conc':<5} {'side':<10} {'TTFT p50 ms':>12} {'added ms':>9} {'CPU ms/req':>11} "
        f"{'net CPU':>8} {'ms/rank':>8}  CPU of"
    ]
    for conc, by_side in head.items():
        for side, d in by_side.items():
            lines.append(
                f"{conc:<5} {side:<10} {d['ttft_p50_ms']:>12.2f} {d['added_ttft_p50_ms']:>9.2f} "
                f"{d['cpu_ms_per_request']:>11.2f} {d['net_cpu_ms_per_request']:>8.2f} "
                f"{d['ttft_per_rank_ms']:>8.2f}  {cpu_of.get(side, '?')}"
            )
    return "\n".join(lines)


def build_report(
    args: argparse.Namespace,
    split: CpuSplit | None,
    prompt_tokens: int,
    loadavg_before: tuple[float, float, float],
    results: dict[str, Any],
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The report of one run: its settings, the CPU placement, the machine, ``results``
    with their headline, and ``extra`` (what the engine's start-up recorded)."""
    stub = args.engine.startswith("stub")
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
        # whether the services sent their streaming calls' requests as made
        # (common.eager_send; LLM_EAGER_SEND=0 in the bench's environment: off)
        "eager_send": eager_send.enabled(),
        "stub_first_token_ms": args.stub_first_token_ms if stub else None,
        "stub_token_gap_ms": args.stub_token_gap_ms if stub else None,
        **(extra or {}),
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
        "complete no character). added_vs_engine and headline: each side - engine "
        "(VllmEngine's Generate under stock-vllm), the median over rounds of that round's "
        "difference; an HTTP side's first token is its first text event.",
        "sides": sides_of(results) if results else [],
        "headline": headline(results) if results else {},
        "results": results,
    }


def print_summary(results: dict[str, Any], cpu_of: Mapping[str, str] | None = None) -> None:
    """Each concurrency's medians, proxy CPU and gateway stages, then the paired
    figures, then the headline table (``cpu_of``: whose CPU each side's is; by default
    the bare relay's on floor, the gateway's elsewhere)."""
    sides = sides_of(results)
    for conc in ("c1", "c32"):
        res = {k: d for k, d in results[conc].items() if k not in DERIVED}
        print(conc, json.dumps({k: {m: round(v, 2) for m, v in d.items()} for k, d in res.items()}))
        cpu = {s: results[conc][s]["proxy_cpu_ms_per_request"] for s in sides}
        print(
            f"  {conc} proxy CPU ms per request (floor, work: the relays'; smg, smg-tenant: SMG's; "
            "engine: the gateway's background): "
            + "  ".join(f"{s} {v:.2f}" for s, v in cpu.items())
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
        for name, key in (
            ("gateway gRPC - engine, first token", "gateway_minus_engine_ttft"),
            ("bare relay (floor) - engine, first token", "floor_minus_engine_ttft"),
            ("gateway gRPC - bare relay (floor), first token", "gateway_minus_floor_ttft"),
            ("relay + encode/detokenize (work) - bare relay, first token", "work_minus_floor_ttft"),
            ("HTTP front - gRPC front, first text event", "front_minus_grpc_first_text"),
            ("side - engine, first token (text event over HTTP)", "minus_engine_ttft"),
        ):
            for side, d in p.get(key, {}).items():
                print(
                    f"  {name} [{side}]: p1 {d['p1_ms']:.2f}  p10 {d['p10_ms']:.2f}  "
                    f"p50 {d['p50_ms']:.2f}  p90 {d['p90_ms']:.2f}  p99 {d['p99_ms']:.2f}"
                )
        print(
            "  proxy CPU ms per request: "
            + "  ".join(f"{s} {v:.2f}" for s, v in p["proxy_cpu_ms_per_request"].items())
        )
    owners = cpu_of or {s: "bare relay" if s == "floor" else "gateway" for s in sides}
    print("headline (median over rounds; added = side - engine, paired per round):")
    print(headline_table(headline(results), owners))
