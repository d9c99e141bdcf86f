"""Load generator: open/closed-loop gRPC load on an engine, the gateway or Envoy.

    python -m bench.load run   --spawn --target engine  --rate 2 --duration 30
    python -m bench.load run   --spawn --target gateway --concurrency 8 --mix short_chat \\
        --tenant name=gold,priority=CRITICAL,share=1 --tenant name=free,priority=LOW,share=3
    python -m bench.load sweep --spawn --target engine --ttft-p95-target-ms 2000
    python -m bench.load fairness --spawn    # experiments (a) (b) (c), bench/loadlib/fairness.py
    python -m bench.load run --target gateway --address 127.0.0.1:50051 \\
        --admin-key-file .run/admin.key --engine-stats 127.0.0.1:50071 \\
        --service-token-file .run/service.token

Without --spawn, point --address at a running service (and --engine-stats at its
engines). Every run is bounded by --num-requests and --duration. Reports go
to bench/reports/load_<name>.{json,png} (see docs/operations.md for how to
read them). The machines are shared: read ratios and medians, not absolutes.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.loadlib import fairness, plots
from bench.loadlib.driver import RunConfig
from bench.loadlib.runner import Endpoint, Phase, run_phase_sync
from bench.loadlib.spawn import BENCH_ENGINE_ENV, Stack, StackSpec, setup_tenants
from bench.loadlib.stats import Slo, format_table
from bench.loadlib.sweep import SweepConfig, run_sweep
from bench.loadlib.workload import SHAPES, Caps, TenantSpec, TextPool
from bench.report import REPORT_DIR, stamp_machine
from common.config import default_model_dir
from common.service_auth import read_service_token
from tokenizer_svc.tokenizer import TextTokenizer


def _common(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("target")
    g.add_argument("--target", choices=["engine", "gateway", "envoy"], default="engine")
    g.add_argument("--address", help="host:port of the target (not with --spawn)")
    g.add_argument("--engine-stats", default="", help="engines to poll GetStats on, a,b")
    g.add_argument("--admin-key", default="", help="admin key: creates the tenants")
    g.add_argument("--admin-key-file", help="file holding the admin key")
    g.add_argument(
        "--service-token-file",
        default="",
        help="the engines' internal-call secret (make run: .run/service.token; "
        "needed to call or poll its engines directly)",
    )
    g.add_argument(
        "--ca-cert",
        default="",
        help="TLS to --address, trusting this CA (make run's Envoy: .run/tls/ca.crt)",
    )
    g.add_argument("--spawn", action="store_true", help="start the services it needs")
    g.add_argument("--num-engines", type=int, default=1)
    g.add_argument(
        "--engine-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="engine env for --spawn, e.g. LLM_ENGINE_CORE_SCHEDULER_MAX_NUM_SEQS=32",
    )
    g.add_argument("--model-dir", default=str(default_model_dir()))
    w = p.add_argument_group("workload")
    w.add_argument("--mix", default="chatlike", help=f"shapes {sorted(SHAPES)}, a:0.8,b:0.2")
    w.add_argument(
        "--tenant",
        action="append",
        default=[],
        metavar="SPEC",
        help="name=..,priority=LOW|NORMAL|CRITICAL,share=..,rate=..,"
        "concurrency=..,mix=..,rpm=..,tpm=..,max_concurrent=..",
    )
    w.add_argument("--rate", type=float, default=0.0, help="req/s, open loop (0 = closed)")
    w.add_argument("--concurrency", type=int, default=4, help="closed-loop workers")
    w.add_argument("--burstiness", type=float, default=1.0, help="gamma shape, 1 = Poisson")
    w.add_argument("--num-requests", type=int, default=200)
    w.add_argument("--duration", type=float, default=30.0, help="seconds of issuing")
    w.add_argument("--drain-timeout", type=float, default=30.0)
    w.add_argument("--request-timeout", type=float, default=120.0)
    w.add_argument("--max-prompt-tokens", type=int, default=0)
    w.add_argument("--max-output-tokens", type=int, default=0)
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--slo-ttft-ms", type=float, default=0.0)
    w.add_argument("--slo-tpot-ms", type=float, default=0.0)
    w.add_argument("--no-progress", action="store_true")
    p.add_argument("--name", default="", help="report name (default: the command)")
    p.add_argument("--out-dir", default=str(REPORT_DIR))


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Flags of the three commands."""
    parser = argparse.ArgumentParser(
        prog="python -m bench.load",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _common(sub.add_parser("run", help="one load run"))
    sw = sub.add_parser("sweep", help="rising open-loop rates until p95 TTFT crosses a target")
    _common(sw)
    sw.add_argument("--ttft-p95-target-ms", type=float, default=2000.0)
    sw.add_argument("--rates", default="", help="explicit rates a,b,c (else start*factor^i)")
    sw.add_argument("--rate-start", type=float, default=0.5)
    sw.add_argument("--rate-factor", type=float, default=2.0)
    sw.add_argument("--max-steps", type=int, default=6)
    sw.add_argument("--refine", type=int, default=1)
    fp = sub.add_parser("fairness", help="fairness and priority experiments (gateway)")
    _common(fp)
    fairness.add_args(fp)
    return parser.parse_args(argv)


def build_phase(args: argparse.Namespace, endpoint: Endpoint) -> Phase:
    """The Phase described by the flags."""
    tenants = [TenantSpec.parse(t) for t in args.tenant] or [TenantSpec("bench")]
    run = RunConfig(
        rate=args.rate,
        concurrency=args.concurrency,
        burstiness=args.burstiness,
        num_requests=args.num_requests,
        duration=args.duration,
        drain_timeout=args.drain_timeout,
        request_timeout=args.request_timeout,
        seed=args.seed,
        progress=not args.no_progress,
    )
    return Phase(
        endpoint,
        tenants,
        run,
        args.mix,
        Caps(args.max_prompt_tokens, args.max_output_tokens),
        Slo(args.slo_ttft_ms, args.slo_tpot_ms),
    )


def _admin_key(args: argparse.Namespace, stack: Stack | None) -> str:
    if stack is not None:
        return stack.admin_key
    if args.admin_key_file:
        return Path(args.admin_key_file).read_text().strip()
    return str(args.admin_key)


def _endpoint(args: argparse.Namespace, stack: Stack | None) -> Endpoint:
    if stack is None:
        if not args.address:
            raise SystemExit("give --address HOST:PORT of a running target, or --spawn")
        stats = [a for a in args.engine_stats.split(",") if a]
        if args.target == "engine" and not stats:
            stats = [args.address]
        return Endpoint(
            args.target,
            args.address,
            stats,
            read_service_token(args.service_token_file),
            Path(args.ca_cert).read_bytes() if args.ca_cert else None,
        )
    address = {
        "engine": stack.engines[0] if stack.engines else "",
        "gateway": stack.gateway,
        "envoy": stack.envoy,
    }[args.target]
    return Endpoint(args.target, address, list(stack.engines))


def execute(args: argparse.Namespace, stack: Stack | None, out_dir: Path) -> dict[str, Any]:
    """Run the command against the endpoint; write and return its report."""
    endpoint = _endpoint(args, stack)
    phase = build_phase(args, endpoint)
    pool = TextPool(TextTokenizer(args.model_dir), args.seed)
    admin_key = _admin_key(args, stack)
    name = args.name or args.command
    loadavg_before = os.getloadavg()
    if args.command == "fairness":
        report = fairness.run_all(args, endpoint, admin_key, pool, out_dir / f"load_{name}.png")
    else:
        if endpoint.kind != "engine" and admin_key:
            tag = f"-{uuid.uuid4().hex[:6]}"
            setup_tenants(endpoint.address, admin_key, phase.tenants, tag, endpoint.ca_cert)
        if args.command == "sweep":
            cfg = SweepConfig(
                args.ttft_p95_target_ms,
                [float(r) for r in args.rates.split(",") if r],
                args.rate_start,
                args.rate_factor,
                args.max_steps,
                args.refine,
            )
            report = run_sweep(phase, pool, cfg)
            plots.plot_sweep(
                report["points"],
                cfg.ttft_p95_target_ms,
                report["sustainable_rate"],
                out_dir / f"load_{name}.png",
                "offered rate (req/s)",
            )
            print(report["verdict"])
        else:
            report, records = run_phase_sync(phase, pool)
            plots.plot_run(
                records,
                report["engine"],
                out_dir / f"load_{name}.png",
                f"{endpoint.kind}: {args.mix}",
            )
            print(format_table(report["overall"], f"{endpoint.kind} {name}"))
            versions = report.get("per_version", {})
            if len(versions) > 1:  # a canary beside the stable version
                for version, summary in versions.items():
                    print(format_table(summary, f"version {version}"))
    report["machine"] = {"loadavg_before": loadavg_before}
    stamp_machine(report)  # CPU, ISA flags, cores, load average at the end
    (out_dir / f"load_{name}.json").write_text(json.dumps(report, indent=1, default=str))
    print(f"report: {out_dir / f'load_{name}.json'} (+ .png)")
    return report


def _exit_on_signal(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    args = parse_args(argv)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if not args.spawn:
        execute(args, None, out_dir)
        return 0
    # a SIGTERM (timeout, kill) unwinds like Ctrl-C, so the spawned services are stopped
    signal.signal(signal.SIGTERM, _exit_on_signal)
    work = Path(tempfile.mkdtemp(prefix="bench-load-"))
    spec = StackSpec(
        Path(args.model_dir),
        work,
        args.num_engines,
        gateway=args.command == "fairness" or args.target != "engine",
        envoy=args.target == "envoy",
        engine_env={**BENCH_ENGINE_ENV, **dict(kv.split("=", 1) for kv in args.engine_env)},
    )
    with Stack(spec) as stack:
        print(
            f"spawned: engines {stack.engines} gateway {stack.gateway or '-'} "
            f"envoy {stack.envoy or '-'} (logs {work})"
        )
        execute(args, stack, out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
