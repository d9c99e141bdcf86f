"""Capacity template: how many sequences of what length fit in a memory budget.

    python -m bench.capacity [--memory-gib 8] [--kv-dtype fp32,bf16,fp8]
        [--weight-dtype bf16] [--contexts 256,512,...] [--measure] [--out DIR]

Accounting for one engine replica (bytes)::

    memory budget = weights + activations + runtime overhead + KV pool
    KV per token  = 2 (K,V) x layers x kv_heads x head_dim x sizeof(kv dtype)
    KV blocks     = KV pool // (KV per token x block_size)
    max seqs(L)   = min(max_num_seqs, KV blocks // ceil(L / block_size))

Weights: every parameter once (tied embeddings once); FP8 keeps embeddings and
norms in bf16 plus one fp32 scale per output channel. Activations: the peak of
one step of ``max_num_batched_tokens`` tokens (hidden, q/k/v, gate/up, fp32
logits and probs of ``max_num_seqs`` rows). Runtime overhead (interpreter,
torch, gRPC; CUDA context on GPUs) is a flag, or measured with ``--measure``.

``--measure`` runs a real ``LLMEngine`` in-process on CPU with a small pool
and, for each context L, submits c requests of exactly L tokens (prompt +
min(32, L/4) output): the peak KV blocks in use, the most requests running
at once and the preemptions are drawn beside the prediction for that pool. Writes
``capacity.json`` and ``capacity.png``.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import resource
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from common.config import ROOT, default_model_dir
from engine_svc.models.config import ModelConfig, load_model_config

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
_TORCH_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
_MIB = 1 << 20


@dataclass(slots=True)
class Budget:
    """Where the memory of one replica goes (bytes) and what the KV pool then holds."""

    kv_dtype: str
    memory: int
    weights: int
    activations: int
    runtime_overhead: int
    kv_pool: int
    kv_bytes_per_token: int
    num_blocks: int
    tokens: int


def num_params(cfg: ModelConfig) -> tuple[int, int]:
    """(parameters in linear layers, parameters elsewhere: embeddings and norms)."""
    h, q, kv = (
        cfg.hidden_size,
        cfg.num_attention_heads * cfg.head_dim,
        cfg.num_key_value_heads * cfg.head_dim,
    )
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * cfg.intermediate_size
    linear = cfg.num_hidden_layers * per_layer
    other = cfg.vocab_size * h + (2 * cfg.num_hidden_layers + 1) * h
    if not cfg.tie_word_embeddings:
        linear += cfg.vocab_size * h
    return linear, other


def weight_bytes(cfg: ModelConfig, dtype: str) -> int:
    """Bytes of the weights in ``dtype`` (fp8: linears 1 byte + fp32 per-channel scales)."""
    linear, other = num_params(cfg)
    if dtype != "fp8":
        return (linear + other) * DTYPE_BYTES[dtype]
    out_channels = cfg.num_hidden_layers * (
        cfg.num_attention_heads * cfg.head_dim
        + 2 * cfg.num_key_value_heads * cfg.head_dim
        + cfg.hidden_size
        + 2 * cfg.intermediate_size
        + cfg.hidden_size
    )
    return linear + 4 * out_channels + 2 * other


def activation_bytes(cfg: ModelConfig, num_tokens: int, num_seqs: int, dtype: str) -> int:
    """Peak transient bytes of one step (estimate, see the module docstring)."""
    act = 4 if dtype == "fp8" else DTYPE_BYTES[dtype]
    kv = cfg.num_key_value_heads * cfg.head_dim
    per_token = (
        4 * cfg.hidden_size
        + cfg.num_attention_heads * cfg.head_dim
        + 2 * kv
        + 3 * cfg.intermediate_size
    )
    return num_tokens * per_token * act + 2 * num_seqs * cfg.vocab_size * 4


def plan(cfg: ModelConfig, args: argparse.Namespace, kv_dtype: str, overhead: int) -> Budget:
    """The budget for one KV dtype."""
    memory = int(args.memory_gib * (1 << 30))
    weights = weight_bytes(cfg, args.weight_dtype)
    acts = activation_bytes(cfg, args.max_num_batched_tokens, args.max_num_seqs, args.weight_dtype)
    per_token = cfg.kv_bytes_per_token(DTYPE_BYTES[kv_dtype])
    pool = max(0, memory - weights - acts - overhead)
    blocks = pool // (per_token * args.block_size)
    return Budget(
        kv_dtype, memory, weights, acts, overhead, pool, per_token, blocks, blocks * args.block_size
    )


def max_seqs(num_blocks: int, context: int, block_size: int) -> int:
    """Sequences of ``context`` tokens that fit in ``num_blocks`` at once."""
    return num_blocks // math.ceil(context / block_size)


def rss_bytes() -> int:
    """Resident set size of this process now."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * resource.getpagesize()


def _run_point(engine: Any, context: int, num_reqs: int, seed: int) -> dict[str, Any]:
    from engine_svc.core.sampling_params import SamplingParams

    rng = random.Random(seed)
    out_len = min(32, context // 4)  # long enough that early requests still run at the peak
    for i in range(num_reqs):
        prompt = [rng.randrange(100, 40000) for _ in range(context - out_len)]
        engine.add_request(
            f"cap-{context}-{num_reqs}-{i}",
            prompt,
            SamplingParams(max_tokens=out_len, ignore_eos=True),
        )
    peak_blocks, peak_running, peak_rss = 0, 0, rss_bytes()
    pre0 = engine.get_stats().num_preemptions_total
    while engine.has_unfinished_requests():
        engine.step()
        s = engine.get_stats()
        peak_blocks = max(peak_blocks, s.num_kv_blocks_used)
        peak_running = max(peak_running, s.num_running)
        peak_rss = max(peak_rss, rss_bytes())
    return {
        "context": context,
        "num_requests": num_reqs,
        "peak_blocks_used": peak_blocks,
        "max_num_running": peak_running,
        "peak_rss": peak_rss,
        "num_preemptions": engine.get_stats().num_preemptions_total - pre0,
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Real LLMEngine runs in this process on CPU (fp32 attention and KV, as served today)."""
    import torch

    from engine_svc.core.config import EngineConfig, SchedulerConfig
    from engine_svc.core.llm_engine import LLMEngine

    torch.set_num_threads(max(1, args.measure_threads))
    rss0, contexts = rss_bytes(), [int(c) for c in args.measure_contexts.split(",")]
    engine = LLMEngine(
        EngineConfig(
            model_dir=args.model_dir,
            dtype=_TORCH_NAMES.get(args.weight_dtype, "bfloat16"),
            device="cpu",
            block_size=args.block_size,
            num_kv_blocks=args.measure_blocks,
            scheduler=SchedulerConfig(
                max_num_seqs=args.measure_max_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
            ),
            max_model_len=max(contexts) + 16,
        )
    )
    rss1 = rss_bytes()
    kv = engine.runner.kv_cache_bytes
    points = []
    for ctx in contexts:
        fits = max_seqs(args.measure_blocks, ctx, args.block_size)
        for c in sorted({*(int(x) for x in args.measure_concurrency.split(",")), fits + 2}):
            p = _run_point(engine, ctx, c, seed=ctx * 31 + c)
            p["predicted_max_seqs"] = min(fits, args.measure_max_seqs)
            p["predicted_peak_blocks"] = min(c, p["predicted_max_seqs"]) * math.ceil(
                ctx / args.block_size
            )
            points.append(p)
            print(
                "  measured L={context} c={num_requests}: peak blocks {peak_blocks_used} "
                "(predicted {predicted_peak_blocks}), max running {max_num_running} "
                "(predicted {predicted_max_seqs}), preemptions {num_preemptions}".format(**p)
            )
    peak = max(p["peak_rss"] for p in points)
    return {
        "pool_blocks": args.measure_blocks,
        "kv_dtype": engine.model_info().kv_cache_dtype,
        "weight_dtype": engine.model_info().weight_dtype,
        "points": points,
        "rss_runtime_overhead": rss0,
        "rss_after_build": rss1,
        "kv_cache_bytes": kv,
        "weights_measured": rss1 - rss0 - kv,
        "activations_measured": peak - rss1,
    }


def plot(report: dict[str, Any], path: Path) -> None:
    """Max sequences vs context per KV dtype, measured points, and the memory split."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 5))
    for b in report["budgets"]:
        a1.plot(
            report["contexts"],
            [max(r, 0.5) for r in b["max_seqs"]],
            "o-",
            label=f"KV {b['kv_dtype']} ({b['num_blocks']} blocks)",
        )
    a1.axhline(report["max_num_seqs"], color="gray", ls=":", label="max_num_seqs")
    m = report.get("measured")
    if m:
        mc = sorted({p["context"] for p in m["points"]})
        a1.plot(
            mc,
            [max_seqs(m["pool_blocks"], c, report["block_size"]) for c in mc],
            "k--",
            label=f"predicted, measurement pool ({m['pool_blocks']} blocks, {m['kv_dtype']})",
        )
        over = [p for p in m["points"] if p["num_requests"] > p["predicted_max_seqs"]]
        a1.plot(
            [p["context"] for p in over],
            [p["max_num_running"] for p in over],
            "r*",
            ms=12,
            label="measured max running (LLMEngine)",
        )
    a1.set(
        xscale="log",
        yscale="log",
        xlabel="context length (tokens)",
        ylabel="max concurrent sequences",
        title=f"{report['memory_gib']} GiB budget",
    )
    a1.grid(alpha=0.3, which="both"), a1.legend(fontsize=7)
    names = ["weights", "activations", "runtime_overhead", "kv_pool"]
    left = [0.0] * len(report["budgets"])
    for name in names:
        vals = [b[name] / _MIB for b in report["budgets"]]
        a2.barh([b["kv_dtype"] for b in report["budgets"]], vals, left=left, label=name)
        left = [x + v for x, v in zip(left, vals, strict=True)]
    a2.set(xlabel="MiB", title="where the budget goes (per KV dtype)")
    a2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Flags; see the module docstring."""
    p = argparse.ArgumentParser(
        prog="python -m bench.capacity",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model-dir", default=str(default_model_dir()))
    p.add_argument("--memory-gib", type=float, default=8.0, help="memory of one replica")
    p.add_argument("--kv-dtype", default="fp32,bf16,fp8", help="one or more of fp32,bf16,fp8")
    p.add_argument("--weight-dtype", default="bf16", choices=["fp32", "bf16", "fp16", "fp8"])
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument(
        "--runtime-overhead-mib",
        type=float,
        default=-1,
        help="-1 = measured RSS of a bare torch process here (or 512 MiB)",
    )
    p.add_argument("--contexts", default="256,512,1024,2048,4096,8192")
    p.add_argument("--measure", action="store_true", help="real LLMEngine points on CPU")
    p.add_argument("--measure-blocks", type=int, default=128)
    p.add_argument("--measure-contexts", default="128,512,1024")
    p.add_argument("--measure-concurrency", default="1,4")
    p.add_argument("--measure-max-seqs", type=int, default=64)
    p.add_argument("--measure-threads", type=int, default=2)
    p.add_argument("--out", default=str(ROOT / "bench" / "reports"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.capacity``; returns the exit status."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    cfg = load_model_config(args.model_dir)
    measured = measure(args) if args.measure else None
    overhead = (
        int(args.runtime_overhead_mib * _MIB)
        if args.runtime_overhead_mib >= 0
        else (measured["rss_runtime_overhead"] if measured else 512 * _MIB)
    )
    contexts, budgets = [int(c) for c in args.contexts.split(",")], []
    print(
        f"{cfg.name}: {sum(num_params(cfg)):,} parameters, weights "
        f"{weight_bytes(cfg, args.weight_dtype) / _MIB:.0f} MiB ({args.weight_dtype}); "
        f"budget {args.memory_gib} GiB, runtime overhead {overhead / _MIB:.0f} MiB"
    )
    print(
        f"{'kv dtype':>8} {'KV B/token':>10} {'blocks':>8} | "
        + " ".join(f"{'L=' + str(c):>7}" for c in contexts)
        + "   (max seqs, before max_num_seqs)"
    )
    for kv_dtype in args.kv_dtype.split(","):
        b = plan(cfg, args, kv_dtype, overhead)
        seqs = [max_seqs(b.num_blocks, c, args.block_size) for c in contexts]
        budgets.append(
            {
                **asdict(b),
                "max_seqs": seqs,
                "max_seqs_capped": [min(s, args.max_num_seqs) for s in seqs],
            }
        )
        print(
            f"{kv_dtype:>8} {b.kv_bytes_per_token:>10,} {b.num_blocks:>8,} | "
            + " ".join(f"{s:>7,}" for s in seqs)
        )
    report = {
        "model": cfg.name,
        "memory_gib": args.memory_gib,
        "block_size": args.block_size,
        "weight_dtype": args.weight_dtype,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "contexts": contexts,
        "num_params": sum(num_params(cfg)),
        "budgets": budgets,
        "measured": measured,
    }
    (out := Path(args.out)).mkdir(parents=True, exist_ok=True)
    (out / "capacity.json").write_text(json.dumps(report, indent=1))
    plot(report, out / "capacity.png")
    print(f"report: {out / 'capacity.json'} (+ capacity.png)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
