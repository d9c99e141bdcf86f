"""The runs of ``bench.gateway_bench``: every side at concurrency 1 and 32 in rounds,
the side order rotated each round so drift hits every side alike, and concurrency-1
pairs (every side back to back); per run the gateway's stage histograms and the
proxy's CPU time."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import statistics
import time
from collections.abc import Mapping, Sequence
from typing import Any

from tqdm import tqdm

from bench.gatewaylib.placement import process_cpu_seconds
from bench.gatewaylib.scrape import Histo, add_delta, scrape_histograms, stage_figures
from bench.gatewaylib.sides import SIDES, OneRequest, Sample, side_client
from bench.gatewaylib.stats import net_cpu_ms, paired_differences, round_differences, summarize


async def limited(one: OneRequest, num_requests: int, concurrency: int) -> list[Sample]:
    """``num_requests`` calls of ``one`` with at most ``concurrency`` in flight."""
    sem = asyncio.Semaphore(concurrency)

    async def gated() -> Sample:
        async with sem:
            return await one()

    return list(await asyncio.gather(*(gated() for _ in range(num_requests))))


async def run_side(
    side: str,
    addresses: dict[str, str],
    key: str,
    ids: list[int],
    num_requests: int,
    concurrency: int,
    max_tokens: int,
    connections: int = 1,
) -> list[Sample]:
    """``num_requests`` requests with ``concurrency`` in flight; one sample each."""
    async with side_client(side, addresses, key, ids, max_tokens, connections) as one:
        return await limited(one, num_requests, concurrency)


async def run_paired(
    sides: list[str],
    addresses: dict[str, str],
    key: str,
    ids: list[int],
    num_pairs: int,
    max_tokens: int,
    cpu_pids: Mapping[str, int] | None = None,
) -> tuple[dict[str, list[Sample]], dict[str, float]]:
    """Concurrency 1, one request per side back to back, ``num_pairs`` times, the order
    rotated each time: the sides of one pair meet the same machine state, so their
    difference is the front's cost with most of the machine's drift taken out.

    Returns the samples and, per side, the CPU ms per request of the process
    ``cpu_pids`` names for it (read around each request; NaN for a side it does not
    name)."""
    async with contextlib.AsyncExitStack() as stack:
        ones = {
            s: await stack.enter_async_context(side_client(s, addresses, key, ids, max_tokens))
            for s in sides
        }
        out: dict[str, list[Sample]] = {s: [] for s in sides}
        pids = cpu_pids or {}
        cpu = dict.fromkeys(sides, 0.0)
        for i in range(num_pairs):
            k = i % len(sides)
            for s in sides[k:] + sides[:k]:
                c0 = process_cpu_seconds(pids.get(s))
                out[s].append(await ones[s]())
                cpu[s] += process_cpu_seconds(pids.get(s)) - c0
        per_request = {s: cpu[s] / num_pairs * 1000 if num_pairs else math.nan for s in sides}
        return out, per_request


# what a front adds over the engine side, each round: to the first token (the HTTP
# sides' first token is their first text event) and the gaps
ADDED_KEYS = ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")


def round_figures(
    by_side: dict[str, list[dict[str, float]]], owners: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """One concurrency's figures from each side's per-round figures: each side's
    median over rounds, and what each front adds (the median over rounds of that
    round's difference): ``added_vs_engine`` per side; ``added`` (the gRPC front, all
    figures), the floor's split and each HTTP client over the gRPC front where those
    sides ran, and each SMG over the HTTP front (``smg_vs_http``, ``smg_tenant_vs_http``:
    the same client and request on both); ``net_cpu_ms_per_request`` per side, the CPU
    of the proxy ``owners`` names for it net of that proxy's background
    (``stats.net_cpu_ms``)."""
    med: dict[str, Any] = {
        side: {m: statistics.median(r[m] for r in rounds) for m in rounds[0]}
        for side, rounds in by_side.items()
        if rounds
    }
    med["added"] = round_differences(by_side["gateway"], by_side["engine"])
    if "floor" in by_side:  # what one more grpc.aio hop costs, the gateway's own work above it
        med["floor_added"] = round_differences(by_side["floor"], by_side["engine"])
        med["gateway_vs_floor"] = round_differences(by_side["gateway"], by_side["floor"])
    if "work" in by_side and "floor" in by_side:  # the work no gateway here can skip
        med["work_vs_floor"] = round_differences(by_side["work"], by_side["floor"])
    for front in (f for f in ("http", "openai", "curl") if f in med):  # the HTTP front
        med[f"{front}_vs_grpc"] = round_differences(
            by_side[front],
            by_side["gateway"],
            ("first_text_p50_ms", "first_text_p99_ms", "event_gap_p50_ms", "event_gap_p99_ms"),
        )
    med["added_vs_engine"] = {
        side: round_differences(rounds, by_side["engine"], ADDED_KEYS)
        for side, rounds in by_side.items()
        if side != "engine" and rounds
    }
    for smg in (s for s in ("smg", "smg-tenant") if s in by_side and "http" in by_side):
        # SMG's HTTP API over the gateway's HTTP front: one client (aiohttp), one request
        med[f"{smg.replace('-', '_')}_vs_http"] = round_differences(
            by_side[smg], by_side["http"], ADDED_KEYS
        )
    med["net_cpu_ms_per_request"] = {
        side: net_cpu_ms(by_side[side], by_side["engine"], proxy)
        for side, proxy in (owners or {}).items()
        if side != "engine" and by_side.get(side)
    }
    return med


def paired_figures(
    paired: dict[str, list[Sample]], cpu_ms: dict[str, float], pairs: int
) -> dict[str, Any]:
    """The concurrency-1 pairs' figures: each side's quantiles, the proxy CPU per
    request, and the per-pair differences (to the first token over the engine for
    every side; over the bare relay where it ran; each HTTP client's first text event
    over the gRPC front)."""
    fronts = {s: rows for s, rows in paired.items() if s not in ("engine", "floor", "work")}
    out: dict[str, Any] = {
        "pairs": pairs,
        "sides": {s: summarize(rows) for s, rows in paired.items()},
        # the proxy's CPU per request of each side (engine: the gateway's background)
        "proxy_cpu_ms_per_request": cpu_ms,
        # every side over the engine: time to the first token (text event over HTTP)
        "minus_engine_ttft": paired_differences(paired, "engine", 0),
        # the gRPC front over the engine: time to the first token
        "gateway_minus_engine_ttft": paired_differences(
            {"engine": paired["engine"], "gateway": paired["gateway"]}, "engine", 0
        ),
        # each HTTP client over the gRPC front: time to the first text event
        "front_minus_grpc_first_text": paired_differences(fronts, "gateway", 3),
    }
    if "floor" in paired:
        # the bare relay over the engine (the transport's floor), and the gateway over
        # the bare relay (its own work on the request path): time to the first token
        out["floor_minus_engine_ttft"] = paired_differences(
            {"engine": paired["engine"], "floor": paired["floor"]}, "engine", 0
        )
        out["gateway_minus_floor_ttft"] = paired_differences(
            {"floor": paired["floor"], "gateway": paired["gateway"]}, "floor", 0
        )
    if "floor" in paired and "work" in paired:
        # what encoding each prompt and detokenizing each chunk add to the bare relay
        out["work_minus_floor_ttft"] = paired_differences(
            {"floor": paired["floor"], "work": paired["work"]}, "floor", 0
        )
    return out


def measure(
    args: argparse.Namespace,
    addresses: dict[str, str],
    key: str,
    ids: list[int],
    cpu_pids: Mapping[str, int] | None = None,
    sides: Sequence[str] = SIDES,
    proxies: Mapping[str, int] | None = None,
) -> dict[str, Any]:
    """Every side of ``sides`` at concurrency 1 and 32, ``args.rounds`` rounds, the
    order rotated each round; then ``args.pairs`` concurrency-1 pairs. ``cpu_pids``
    names the process whose CPU each side is charged; ``proxies`` (name -> pid) the
    processes whose CPU every run records (``<name>_cpu_s``, with the run's time), so
    each side's can be read net of that process's background."""
    order = list(sides)
    proxies = proxies or {}
    owners = {
        side: name
        for side, pid in (cpu_pids or {}).items()
        for name, ppid in proxies.items()
        if pid == ppid
    }
    runs = {"c1": (1, args.requests_c1), "c32": (32, args.requests_c32)}
    per_round: dict[str, dict[str, list[dict[str, float]]]] = {
        c: {name: [] for name in order} for c in runs
    }
    metrics_url = addresses["gateway_metrics"]
    stages: dict[str, dict[str, Histo]] = {}  # per concurrency: what its runs added
    with tqdm(total=args.rounds * len(runs) * len(order), desc="gateway bench", unit="run") as bar:
        for r in range(args.rounds):
            for conc, (n_conc, n_req) in runs.items():
                k = r % len(order)
                before = scrape_histograms(metrics_url)
                for name in order[k:] + order[:k]:  # rotate so drift hits every side
                    pid = (cpu_pids or {}).get(name)
                    c0 = process_cpu_seconds(pid)
                    p0 = {p: process_cpu_seconds(ppid) for p, ppid in proxies.items()}
                    t0 = time.perf_counter()
                    samples = asyncio.run(
                        run_side(
                            name,
                            addresses,
                            key,
                            ids,
                            n_req,
                            n_conc,
                            args.max_tokens,
                            args.connections if n_conc > 1 else 1,
                        )
                    )
                    row = summarize(samples, process_cpu_seconds(pid) - c0)
                    row["run_s"] = time.perf_counter() - t0
                    row["requests"] = len(samples)
                    for p, ppid in proxies.items():
                        row[f"{p}_cpu_s"] = process_cpu_seconds(ppid) - p0[p]
                    per_round[conc][name].append(row)
                    bar.update(1)
                after = scrape_histograms(metrics_url)
                stages[conc] = add_delta(stages.get(conc, {}), before, after)
    results: dict[str, Any] = {
        conc: {
            **round_figures(by_side, owners),
            "gateway_stages": stage_figures(stages.get(conc, {})),
            "by_round": by_side,  # each side's figures per round, in round order
        }
        for conc, by_side in per_round.items()
    }
    if args.pairs:
        paired, cpu_ms = asyncio.run(
            run_paired(order, addresses, key, ids, args.pairs, args.max_tokens, cpu_pids)
        )
        results["c1_paired"] = paired_figures(paired, cpu_ms, args.pairs)
    return results
