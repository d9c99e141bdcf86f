"""Where a first token's time goes in our stack, one request at a time: the same prompt
to the engine's gRPC port directly and through the gateway's OpenAI HTTP front, then to
the engine in this process (no service at all).

    python -m bench.stack_hops [--requests 14] [--warmup 2] [--prompt-tokens 64-512]
                               [--max-tokens 8] [--seed N]

Phase 1 starts the stack as ``make run`` does (``bench.stack_bench.our_stack``: Redis,
tokenizer, our engine with the default config, the gateway with its HTTP front) and
sends each prompt twice, alternating which hop goes first:
  grpc   ``Engine.Generate`` on the engine's port with the prompt's token ids
  http   ``POST /v1/completions`` through the official openai client (the gateway
         authenticates, reserves, tokenizes, routes and relays)
Phase 2 stops the stack by pid and loads the engine in this process with the same
config (the ``engine_core`` section the service loads): ``add_request`` then
``step()`` until the first token.
Each figure is send -> first token (gRPC: first chunk with token ids; HTTP: first
chunk with text; in process: the step that returns it). Per prompt, http - grpc is
what the gateway and its HTTP front add, grpc - in-process what the engine service
adds (its gRPC server, the step thread's hand-off); the report gives both as medians
over prompts (the first ``--warmup`` prompts are not counted) and every prompt's
figures, and the PNG draws them against the prompt's length.
Writes bench/reports/stack_hops.json and .png.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import secrets
import signal
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from bench.report import machine_facts, save_report
from bench.stack_bench import Prompt, exit_on_signal, make_workload, our_stack, timed_completion
from common.config import default_model_dir

HOPS = ("grpc", "http", "inproc")
HOP_NAMES = {
    "grpc": "engine's gRPC port",
    "http": "gateway HTTP front (openai client)",
    "inproc": "engine in process",
}


async def ttft_grpc(stub: Any, ids: list[int], max_tokens: int) -> float:
    """Seconds from sending ``Engine.Generate`` on ``stub`` (a channel kept open across
    requests, as the openai client keeps its connection) to its first chunk with token
    ids."""
    from llm.v1 import engine_pb2

    request = engine_pb2.EngineGenerateRequest(
        request_id=f"hops-{time.time_ns()}",
        prompt_token_ids=ids,
        sampling=engine_pb2.EngineSamplingParams(max_tokens=max_tokens, ignore_eos=True),
    )
    t0 = time.perf_counter()
    first = None
    async for chunk in stub.Generate(request):
        if chunk.token_ids and first is None:
            first = time.perf_counter()
    if first is None:
        raise RuntimeError("the engine's stream carried no token")
    return first - t0


async def through_stack(
    prompts: list[Prompt], ids: list[list[int]], max_tokens: int, bar: tqdm[Any]
) -> list[dict[str, float]]:
    """Phase 1: every prompt over gRPC and over HTTP, alternating which goes first."""
    import grpc
    import openai

    from llm.v1 import engine_pb2_grpc

    rows: list[dict[str, float]] = []
    with our_stack(Path(tempfile.mkdtemp(prefix="stack-hops-"))) as endpoint:
        client = openai.AsyncOpenAI(base_url=endpoint.url + "/v1", api_key=endpoint.api_key)
        async with grpc.aio.insecure_channel(endpoint.facts["engine_address"]) as channel:
            stub = engine_pb2_grpc.EngineStub(channel)
            for i, (p, toks) in enumerate(zip(prompts, ids, strict=True)):
                row: dict[str, float] = {"tokens": p.tokens}
                for hop in ("grpc", "http") if i % 2 else ("http", "grpc"):
                    if hop == "grpc":
                        row["grpc"] = await ttft_grpc(stub, toks, max_tokens)
                    else:
                        timed = await timed_completion(client, "", p.text, max_tokens)
                        row["http"] = timed.ttft_s
                    await asyncio.sleep(0.2)  # the engine idle again, as a lone user leaves it
                rows.append(row)
                bar.update()
        await client.close()
    return rows


def in_process(ids: list[list[int]], max_tokens: int, bar: tqdm[Any]) -> list[float]:
    """Phase 2: each prompt to an engine in this process, first token's seconds."""
    from common.config import load_config
    from engine_svc.core import EngineConfig, LLMEngine, SamplingParams

    # the engine_core section the stack's engine service loads (config/stack.yaml)
    config = load_config(
        EngineConfig, "engine_core", overrides={"model_dir": str(default_model_dir())}
    )
    engine = LLMEngine(config)
    out = []
    for i, toks in enumerate(ids):
        t0 = time.perf_counter()
        engine.add_request(
            f"hops-{i}", toks, SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        )
        first = None
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.new_token_ids and first is None:
                    first = time.perf_counter()
        if first is None:
            raise RuntimeError("the engine finished a request without a token")
        out.append(first - t0)
        time.sleep(0.2)
        bar.update()
    return out


def summarize(rows: list[dict[str, float]], warmup: int) -> dict[str, float]:
    """Medians over the counted prompts: each hop's TTFT (ms) and what each layer adds
    per prompt (``gateway_ms`` = http - grpc, ``engine_service_ms`` = grpc - in process)."""
    counted = rows[warmup:]
    if not counted:
        raise ValueError(f"no prompt past the {warmup} warm-up ones")

    def med(f: Callable[[dict[str, float]], float]) -> float:
        return float(statistics.median(1000 * f(r) for r in counted))

    return {
        "grpc_p50_ms": med(lambda r: r["grpc"]),
        "http_p50_ms": med(lambda r: r["http"]),
        "inproc_p50_ms": med(lambda r: r["inproc"]),
        "gateway_ms": med(lambda r: r["http"] - r["grpc"]),
        "engine_service_ms": med(lambda r: r["grpc"] - r["inproc"]),
        "ms_per_prompt_token": statistics.median(1000 * r["inproc"] / r["tokens"] for r in counted),
    }


def plot(rows: list[dict[str, float]], warmup: int, facts: dict[str, Any], path: Path) -> None:
    """Each hop's TTFT against the prompt's length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    counted = rows[warmup:]
    for hop, marker in zip(HOPS, "o^s", strict=True):
        ax.scatter(
            [r["tokens"] for r in counted], [1000 * r[hop] for r in counted],
            marker=marker, label=HOP_NAMES[hop], alpha=0.8,
        )  # fmt: skip
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("time to first token, ms")
    ax.legend(fontsize=8)
    ax.set_title(f"first token per hop, one request at a time — {facts['cpu']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--requests", type=int, default=14, help="prompts, warm-up included")
    ap.add_argument("--warmup", type=int, default=2, help="first prompts not counted")
    ap.add_argument("--prompt-tokens", default="64-512", help="prompt lengths, LO-HI tokens")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--seed", type=int, default=None, help="prompt seed (default: fresh)")
    ap.add_argument("--out", default="stack_hops", help="report name under bench/reports")
    args = ap.parse_args(argv)
    lo, _, hi = args.prompt_tokens.partition("-")
    args.prompt_tokens = (int(lo), int(hi or lo))
    args.seed = secrets.randbits(32) if args.seed is None else args.seed
    if args.requests <= args.warmup:
        ap.error("--requests must be more than --warmup")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    # a SIGTERM unwinds like Ctrl-C: every started service is stopped by pid
    signal.signal(signal.SIGTERM, exit_on_signal)
    from tokenizer_svc.tokenizer import TextTokenizer

    tok = TextTokenizer(default_model_dir())
    rng = random.Random(args.seed)
    prompts = make_workload(tok, rng.randrange(2**32), args.requests, 0, 0, args.prompt_tokens)[
        "c1"
    ]
    ids = [tok.encode(p.text) for p in prompts]
    facts = machine_facts()
    with tqdm(total=2 * len(prompts), desc="stack_hops", unit="prompt") as bar:
        rows = asyncio.run(through_stack(prompts, ids, args.max_tokens, bar))
        for row, s in zip(rows, in_process(ids, args.max_tokens, bar), strict=True):
            row["inproc"] = s
    table = summarize(rows, args.warmup)
    report = {
        "bench": "stack_hops",
        "machine": facts,
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "figures": table,
        "hops": HOP_NAMES,
        "prompts": rows,
    }
    path = save_report(args.out, report, lambda png: plot(rows, args.warmup, facts, png))
    for k, v in table.items():
        print(f"{k:>22}: {v:.2f}")
    print(f"report: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
