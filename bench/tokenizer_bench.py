"""Tokenizer throughput: 1 KB prompts, in-process vs through gRPC.

    python -m bench.tokenizer_bench [--num-texts 512] [--repeats 5] [--concurrency 8]

Modes, each measured --repeats times (the median is reported):
  in-process         TextTokenizer.encode, one text at a time
  in-process batch   TextTokenizer.encode_batch over all texts
  grpc unary         Encode RPCs one after another (sync client)
  grpc concurrent    Encode RPCs with N in flight (grpc.aio client)
  grpc batch         EncodeBatch RPCs of 64 texts

Writes bench/reports/tokenizer_bench.json and .png.
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
from tqdm import tqdm

from bench.loadlib.spawn import Stack
from bench.report import save_report
from common.config import ROOT, default_model_dir
from llm.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from tokenizer_svc.tokenizer import TextTokenizer

CORPUS = ROOT / "tests" / "data" / "tokenizer_corpus.txt"


def make_texts(n: int, size: int = 1024, seed: int = 0) -> list[str]:
    """n prompts of ~size characters, sliced from the multilingual corpus."""
    src = CORPUS.read_text(encoding="utf-8")
    src = src * (1 + 4 * size // len(src))
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        start = rng.randrange(0, len(src) - size)
        out.append(src[start : start + size])
    return out


def timed(fn: Callable[[], int]) -> tuple[float, int]:
    t0 = time.perf_counter()
    num_tokens = fn()
    return time.perf_counter() - t0, num_tokens


def run_grpc_concurrent(address: str, texts: list[str], concurrency: int) -> int:
    async def go() -> int:
        async with grpc.aio.insecure_channel(address) as ch:
            stub = tokenizer_pb2_grpc.TokenizerStub(ch)
            sem = asyncio.Semaphore(concurrency)

            async def one(t: str) -> int:
                async with sem:
                    r = await stub.Encode(tokenizer_pb2.EncodeRequest(text=t))
                    return len(r.token_ids)

            return sum(await asyncio.gather(*(one(t) for t in texts)))

    return asyncio.run(go())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--num-texts", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--concurrency", type=int, default=8)
    args = ap.parse_args(argv)
    texts = make_texts(args.num_texts)
    tok = TextTokenizer(default_model_dir())
    services = Stack.alone(Path(tempfile.mkdtemp(prefix="tokbench-")))
    quiet = ["--metrics-port", "-1", "--log-level", "warning"]
    server = services.service("tokenizer-bench", "tokenizer_svc", quiet)
    results: dict[str, Any] = {}
    try:
        channel = grpc.insecure_channel(server.address)
        stub = tokenizer_pb2_grpc.TokenizerStub(channel)
        stub.Encode(tokenizer_pb2.EncodeRequest(text="warm up"))

        def batches() -> int:
            n = 0
            for i in range(0, len(texts), 64):
                reqs = [tokenizer_pb2.EncodeRequest(text=t) for t in texts[i : i + 64]]
                resp = stub.EncodeBatch(tokenizer_pb2.EncodeBatchRequest(requests=reqs))
                n += sum(len(r.token_ids) for r in resp.responses)
            return n

        modes: dict[str, Callable[[], int]] = {
            "in-process": lambda: sum(len(tok.encode(t)) for t in texts),
            "in-process batch": lambda: sum(map(len, tok.encode_batch(texts))),
            "grpc unary": lambda: sum(
                len(stub.Encode(tokenizer_pb2.EncodeRequest(text=t)).token_ids) for t in texts
            ),
            f"grpc concurrent x{args.concurrency}": lambda: run_grpc_concurrent(
                server.address, texts, args.concurrency
            ),
            "grpc batch (64/call)": batches,
        }
        bar = tqdm(total=len(modes) * args.repeats, desc="tokenizer bench", unit="run")
        for name, fn in modes.items():
            secs, ntok = [], 0
            for _ in range(args.repeats):
                s, ntok = timed(fn)
                secs.append(s)
                bar.update()
            med = statistics.median(secs)
            results[name] = {
                "seconds_median": med,
                "texts_per_s": len(texts) / med,
                "tokens_per_s": ntok / med,
                "us_per_text": 1e6 * med / len(texts),
                "num_tokens": ntok,
                "runs": secs,
            }
        bar.close()
        channel.close()
    finally:
        services.stop()
    base = results["in-process"]["texts_per_s"]
    print(f"\n{len(texts)} texts of ~1 KB, median of {args.repeats} runs")
    print(f"{'mode':<26}{'texts/s':>10}{'tokens/s':>12}{'us/text':>10}{'vs in-process':>15}")
    for name, r in results.items():
        print(
            f"{name:<26}{r['texts_per_s']:>10.0f}{r['tokens_per_s']:>12.0f}"
            f"{r['us_per_text']:>10.1f}{r['texts_per_s'] / base:>14.2f}x"
        )
    report = {
        "bench": "tokenizer",
        "num_texts": len(texts),
        "text_chars": 1024,
        "repeats": args.repeats,
        "python": platform.python_version(),
        "results": results,
    }
    save_report("tokenizer_bench", report, lambda path: plot(results, path))
    return 0


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, ax = plt.subplots(figsize=(8, 3.5))
    vals = [results[n]["texts_per_s"] for n in names]
    ax.barh(names, vals, color=["#4c72b0" if "in-process" in n else "#dd8452" for n in names])
    for i, v in enumerate(vals):
        ax.text(v, i, f" {v:,.0f}", va="center")
    ax.set_xlabel("1 KB texts encoded per second (median)")
    ax.set_title("Tokenizer encode throughput: in-process vs gRPC")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
