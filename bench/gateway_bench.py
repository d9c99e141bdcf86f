"""Latency the gateway adds: engine called directly vs through the gateway's gRPC front
and through its OpenAI-compatible HTTP front (SSE), side by side.

    python -m bench.gateway_bench [--rounds 3] [--requests-c1 16] [--requests-c32 64]
                                  [--max-tokens 16] [--pairs 100]
                                  [--engine model|stub|stock-vllm|stub-vllm]
                                  [--stub-first-token-ms 0] [--stub-token-gap-ms 0]
                                  [--engine-cores 0]
                                  [--proxy-cores 0]

Starts Redis, tokenizer_svc, one engine replica, a bare relay and ``python -m gateway``
on free ports (``bench.gatewaylib.stack``), creates the bench tenant, then for
concurrency 1 and 32 runs the same greedy requests against every side
(``bench.gatewaylib.sides``: engine, floor, gateway, http, openai, curl) in alternating
rounds so drift hits every side alike (``bench.gatewaylib.measure``). Per request it
records TTFT (send -> first token) and the mean inter-token time; per round the p50/p99
of each; the report holds each side's median over rounds, and what a front adds is the
median over rounds of that round's difference (``bench.gatewaylib.stats``). The gateway
side includes everything the gateway does: auth (cached), tokenizing (in process), the
Redis calls (request unit + lease, then tokens; ``--unlimited-tenant`` skips the token
call), routing, incremental detokenization, settling. http, openai and curl - gateway
are what the HTTP front adds over the gRPC front (first text event against first text
event).

``floor - engine`` is the transport's share of what the gateway adds (one more grpc.aio
hop, ``bench.gatewaylib.relay_floor``) and ``gateway - floor`` the gateway's own work on
the request path; both per round and per pair. Beside the client-side figures come the
gateway's own stage histograms (``bench.gatewaylib.scrape``) and the proxy's CPU time
per request; ``--engine-cores`` / ``--proxy-cores`` place the processes on CPUs of their
own (``bench.gatewaylib.placement``); ``--engine stub`` puts the engine service with no
model behind both sides (``bench.gatewaylib.stub_engine``).

``--engine stock-vllm`` puts the stock vLLM gRPC server (``deploy.stock_vllm``) under
the gateway (as ``vllm://``) and under SMG, the ``smg`` wheel's gateway, side by side
(``bench.gatewaylib.stock``): the sides are engine (VllmEngine's Generate), gateway,
http and smg (SMG's OpenAI API, the http side's request), and each side's CPU per
request is that of the process in front of the engine (the gateway with its workers,
or SMG). It writes gateway_bench_stock_vllm.json and .png. ``--engine stub-vllm`` runs
the same five sides over the stub engine speaking VllmEngine (no model, no CPU of its
own, first token and later tokens held as ``--stub-first-token-ms`` and
``--stub-token-gap-ms`` say): the two gateways' difference without the engine's jitter or
its competition for the cores, on any CPU (gateway_bench_stub_vllm.json and .png).

Writes bench/reports/gateway_bench.json and .png (``bench.gatewaylib.report``, ``.plot``);
every run prints the headline table: per concurrency and side, TTFT p50, what the side
adds over the engine (paired per round) and the CPU per request of the proxy.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.gatewaylib.measure import measure, run_side
from bench.gatewaylib.placement import CpuSplit, split_cpus
from bench.gatewaylib.plot import plot
from bench.gatewaylib.report import build_report, print_summary
from bench.gatewaylib.sides import PROMPT, SIDES
from bench.gatewaylib.stack import ENGINE_MODULES, make_key, start_stack
from bench.gatewaylib.stock import (
    STOCK_ENGINES,
    STOCK_SIDES,
    StubTiming,
    cpu_owner,
    stock_stack,
)
from bench.loadlib.spawn import on_cpus
from bench.report import save_report
from common.config import default_model_dir
from tokenizer_svc.tokenizer import TextTokenizer

STOCK = "stock-vllm"


def bench_sides(engine: str) -> list[str]:
    """The sides a run measures over ``engine``."""
    return list(STOCK_SIDES) if engine in STOCK_ENGINES else list(SIDES)


def report_name(engine: str) -> str:
    """The report's name under bench/reports (each VllmEngine run keeps its own)."""
    if engine in STOCK_ENGINES:
        return "gateway_bench_" + engine.replace("-", "_")
    return "gateway_bench"


def cpu_owners(engine: str) -> dict[str, str]:
    """Which proxy's CPU time each side is charged: the process in front of the engine
    there (on the engine side, the gateway's background)."""
    if engine in STOCK_ENGINES:
        return {s: cpu_owner(s) for s in STOCK_SIDES}
    return {s: "floor" if s == "floor" else "gateway" for s in SIDES}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The bench's flags."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests-c1", type=int, default=16)
    parser.add_argument("--requests-c32", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument(
        "--unlimited-tenant",
        action="store_true",
        help="a tenant with no limits (no token check: one Redis call); SMG's tenant "
        "(the smg-tenant side) then only has its key checked",
    )
    parser.add_argument(
        "--engine-dtype",
        default="",
        help="the engine's weight dtype (default float32, as the tests; bfloat16 with "
        "--engine stock-vllm, as its tests; auto: its own choice, as `make run`). The "
        "engine's step-to-step jitter is the noise every paired difference carries",
    )
    parser.add_argument(
        "--engine",
        choices=[*sorted(ENGINE_MODULES), *STOCK_ENGINES],
        default="model",
        help="model: the real engine; stub: the engine service with no model behind it "
        "(tokens at once), so both sides differ by the gateway alone, without the "
        "model's jitter (bench.gatewaylib.stub_engine); stock-vllm: the stock vLLM gRPC "
        "server with the gateway and SMG in front of it (bench.gatewaylib.stock); "
        "stub-vllm: the stub engine speaking VllmEngine with the gateway and SMG in "
        "front of it, so the two gateways differ by themselves alone",
    )
    parser.add_argument(
        "--stub-first-token-ms",
        type=float,
        default=0.0,
        help="with a stub engine: hold each first token this long (a prefill's wait, no "
        "CPU), so what the gateway overlaps with the engine's start is hidden as behind "
        "a real model",
    )
    parser.add_argument(
        "--stub-token-gap-ms",
        type=float,
        default=0.0,
        help="with a stub engine: space the later tokens this far apart (a decode step's "
        "wait, no CPU); 0 = back to back",
    )
    parser.add_argument(
        "--pairs",
        type=int,
        default=100,
        help="concurrency-1 paired requests (every side back to back, order rotated); 0 = skip",
    )
    parser.add_argument(
        "--engine-cores",
        type=int,
        default=0,
        help="pin the engine to this many CPUs (one torch thread each) and Redis, the "
        "tokenizer, the bare relay, the gateway and this client to the rest, as a "
        "deployment gives a proxy cores of its own; 0 = everything shares every core",
    )
    parser.add_argument(
        "--proxy-cores",
        type=int,
        default=0,
        help="pin the gateway (and its workers) and the bare relay to this many CPUs of "
        "their own, the last ones, and the client, Redis and the tokenizer (and the "
        "engine, without --engine-cores) to the rest: the proxy's latency when it does "
        "not compete with the client for a core; 0 = no cores of its own",
    )
    parser.add_argument(
        "--gateway-workers",
        type=int,
        default=1,
        help="the gateway's worker processes ([gateway] workers; its CPU figures are "
        "the supervisor's and its workers' together)",
    )
    parser.add_argument(
        "--connections",
        type=int,
        default=1,
        help="at concurrency 32, the gRPC sides' requests spread over this many "
        "connections (workers share connections, not the streams of one)",
    )
    args = parser.parse_args(argv)
    args.engine_dtype = args.engine_dtype or ("bfloat16" if args.engine == STOCK else "float32")
    return args


def open_sides(
    args: argparse.Namespace, split: CpuSplit | None, closing: contextlib.ExitStack
) -> tuple[str, dict[str, str], dict[str, int], dict[str, Any]]:
    """Start the services of ``args.engine`` (stopped when ``closing`` closes); returns
    the admin key, each side's address, the proxies' pids by name (``cpu_owners``) and
    what the report records of the start."""
    log_dir = Path(tempfile.mkdtemp(prefix="gw-bench-"))
    engine_cpus = split.engine if split else None
    proxy_cpus = split.proxy if split else None
    if args.engine in STOCK_ENGINES:
        stub = None
        if args.engine != STOCK:
            stub = StubTiming(args.stub_first_token_ms, args.stub_token_gap_ms)
        run = closing.enter_context(
            stock_stack(
                log_dir,
                args.engine_dtype,
                engine_cpus,
                args.gateway_workers,
                proxy_cpus,
                stub,
                not args.unlimited_tenant,
            )
        )
        return run.stack.admin_key, run.addresses, run.proxies, run.facts
    stack, addresses = start_stack(
        log_dir,
        args.engine_dtype,
        args.engine,
        StubTiming(args.stub_first_token_ms, args.stub_token_gap_ms),
        engine_cpus,
        args.gateway_workers,
        proxy_cpus,
    )
    closing.callback(stack.stop)
    gw_proc, floor_proc = stack.procs["bench-gateway"].proc, stack.procs["floor"].proc
    assert gw_proc is not None  # started above
    assert floor_proc is not None
    return stack.admin_key, addresses, {"gateway": gw_proc.pid, "floor": floor_proc.pid}, {}


def main(argv: Sequence[str] | None = None) -> None:
    """Start the stack, measure every side, save and print the report."""
    args = parse_args(argv)
    split = split_cpus(args.engine_cores, args.proxy_cores)
    sides = bench_sides(args.engine)
    loadavg_before = os.getloadavg()
    ids = TextTokenizer(default_model_dir()).encode(PROMPT)
    # this client, Redis and every later child on the others' CPUs (the engine's own
    # are set around its start)
    with on_cpus(split.rest if split else None), contextlib.ExitStack() as closing:
        admin_key, addresses, proxies, facts = open_sides(args, split, closing)
        owners = cpu_owners(args.engine)
        cpu_pids = {side: proxies[owners[side]] for side in sides}
        key = make_key(addresses["gateway"], admin_key, not args.unlimited_tenant)
        for side in sides:  # warm every path
            asyncio.run(run_side(side, addresses, key, ids, 4, 4, 4))
        results = measure(args, addresses, key, ids, cpu_pids, sides, proxies)
    report = build_report(args, split, len(ids), loadavg_before, results, facts)
    save_report(report_name(args.engine), report, lambda path: plot(report, path))
    print_summary(results, cpu_owners(args.engine))


if __name__ == "__main__":
    main()
