"""Engine over gRPC vs the offline engine: TTFT, TPOT and aggregate tokens/s.

    python -m bench.engine_grpc_bench [--concurrency 1 8 32] [--max-tokens 48] [--repeats 1]

The same workload (fixed-seed prompts of 32-256 tokens, greedy, ignore_eos so
every request produces exactly --max-tokens) runs
  offline: LLMEngine in this process, all requests of a wave added at once,
           stepped until done (timestamps from the engine);
  grpc:    `python -m engine_svc` (same config) as a subprocess, `concurrency`
           streams in flight from a grpc.aio client (timestamps at the client).
Each configuration runs --repeats times; medians are reported, and the
overhead ratio grpc/offline. Writes bench/reports/engine_grpc_bench.{json,png}.
The machine is shared (2 cores): read ratios from one run, not absolutes.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
from tqdm import tqdm

from bench.loadlib.spawn import Stack
from bench.report import save_report
from common.config import default_model_dir
from engine_svc.core.config import EngineConfig, SchedulerConfig
from engine_svc.core.llm_engine import LLMEngine
from engine_svc.core.sampling_params import SamplingParams
from llm.v1 import engine_pb2, engine_pb2_grpc

CORE_ENV = {
    "LLM_ENGINE_CORE_DEVICE": "cpu",
    "LLM_ENGINE_CORE_NUM_KV_BLOCKS": "2048",
    "LLM_ENGINE_CORE_SCHEDULER_MAX_NUM_SEQS": "32",
    "LLM_ENGINE_CORE_MAX_MODEL_LEN": "2048",
}


def workload(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(rng.randrange(32, 257))] for _ in range(n)]


def summarize(ttft: list[float], tpot: list[float], tokens: int, wall: float) -> dict[str, float]:
    return {
        "ttft_p50_ms": 1000 * statistics.median(ttft),
        "ttft_p99_ms": 1000 * sorted(ttft)[max(0, int(len(ttft) * 0.99) - 1)],
        "tpot_p50_ms": 1000 * statistics.median(tpot),
        "tokens_per_s": tokens / wall,
    }


def run_offline(
    engine: LLMEngine, prompts: list[list[int]], conc: int, max_tokens: int
) -> dict[str, float]:
    ttft, tpot, tokens = [], [], 0
    t0 = time.perf_counter()
    for w in range(0, len(prompts), conc):  # waves of `conc` requests, like the client side
        for i, p in enumerate(prompts[w : w + conc]):
            engine.add_request(
                f"o{w + i}", p, SamplingParams(max_tokens=max_tokens, ignore_eos=True)
            )
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens += len(out.new_token_ids)
                if out.finished and out.first_token_time and out.finished_time:
                    ttft.append(out.first_token_time - out.arrival_time)
                    tpot.append((out.finished_time - out.first_token_time) / (max_tokens - 1))
    return summarize(ttft, tpot, tokens, time.perf_counter() - t0)


async def _grpc_run(
    address: str, prompts: list[list[int]], conc: int, max_tokens: int
) -> dict[str, float]:
    ttft: list[float] = []
    tpot: list[float] = []
    tokens = 0
    async with grpc.aio.insecure_channel(address) as ch:
        stub = engine_pb2_grpc.EngineStub(ch)

        async def one(i: int, p: list[int]) -> None:
            nonlocal tokens
            start = time.perf_counter()
            first = last = None
            req = engine_pb2.EngineGenerateRequest(
                request_id=f"g{i}-{time.time_ns()}",
                prompt_token_ids=p,
                sampling=engine_pb2.EngineSamplingParams(max_tokens=max_tokens, ignore_eos=True),
            )
            async for chunk in stub.Generate(req):
                now = time.perf_counter()
                if chunk.token_ids and first is None:
                    first = now
                last = now
                tokens += len(chunk.token_ids)
            assert first is not None
            assert last is not None
            ttft.append(first - start)
            tpot.append((last - first) / (max_tokens - 1))

        t0 = time.perf_counter()
        for w in range(0, len(prompts), conc):
            await asyncio.gather(*(one(w + i, p) for i, p in enumerate(prompts[w : w + conc])))
        wall = time.perf_counter() - t0
    return summarize(ttft, tpot, tokens, wall)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args(argv)
    model_dir = default_model_dir()
    services = Stack.alone(Path(tempfile.mkdtemp(prefix="engbench-")))
    quiet = ["--metrics-port", "-1", "--log-level", "warning"]
    env = {**CORE_ENV, "LLM_ENGINE_CORE_DTYPE": args.dtype}
    server = services.service("engine-bench", "engine_svc", quiet, env, 180)
    engine = LLMEngine(
        EngineConfig(
            model_dir=str(model_dir),
            dtype=args.dtype,
            device="cpu",
            num_kv_blocks=2048,
            scheduler=SchedulerConfig(max_num_seqs=32),
            max_model_len=2048,
        )
    )
    results: dict[str, Any] = {}
    bar = tqdm(total=2 * len(args.concurrency) * args.repeats, desc="engine grpc bench")
    try:
        for conc in args.concurrency:
            prompts = workload(max(4, 2 * conc), seed=conc)
            runs: dict[str, list[dict[str, float]]] = {"offline": [], "grpc": []}
            for _ in range(args.repeats):  # interleaved, so drift hits both alike
                runs["offline"].append(run_offline(engine, prompts, conc, args.max_tokens))
                bar.update()
                runs["grpc"].append(
                    asyncio.run(_grpc_run(server.address, prompts, conc, args.max_tokens))
                )
                bar.update()
            results[str(conc)] = {
                mode: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
                for mode, rs in runs.items()
            }
    finally:
        bar.close()
        services.stop()
    print(f"\nmax_tokens={args.max_tokens}, dtype={args.dtype}, median of {args.repeats}")
    print(
        f"{'conc':>5} {'mode':<8}{'TTFT p50':>10}{'TTFT p99':>10}{'TPOT p50':>10}"
        f"{'tok/s':>9}{'grpc/offline tok/s':>20}"
    )
    for conc, r in results.items():
        for mode in ("offline", "grpc"):
            m = r[mode]
            ratio = m["tokens_per_s"] / r["offline"]["tokens_per_s"]
            print(
                f"{conc:>5} {mode:<8}{m['ttft_p50_ms']:>8.1f}ms{m['ttft_p99_ms']:>8.1f}ms"
                f"{m['tpot_p50_ms']:>8.1f}ms{m['tokens_per_s']:>9.1f}{ratio:>19.2f}x"
            )
    report = {
        "bench": "engine_grpc",
        "max_tokens": args.max_tokens,
        "dtype": args.dtype,
        "repeats": args.repeats,
        "results": results,
    }
    save_report("engine_grpc_bench", report, lambda path: plot(results, path))
    return 0


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    concs = list(results)
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
    for ax, key, label in zip(
        axes,
        ("tokens_per_s", "ttft_p50_ms", "tpot_p50_ms"),
        ("aggregate tokens/s", "TTFT p50 (ms)", "TPOT p50 (ms)"),
        strict=True,
    ):
        for i, mode in enumerate(("offline", "grpc")):
            xs = [j + (i - 0.5) * 0.35 for j in range(len(concs))]
            ax.bar(xs, [results[c][mode][key] for c in concs], width=0.35, label=mode)
        ax.set_xticks(range(len(concs)), [f"c={c}" for c in concs])
        ax.set_title(label)
    axes[0].legend()
    fig.suptitle("Engine: gRPC service vs offline LLMEngine (same workload)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
