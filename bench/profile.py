"""Where a decode step's time goes, for a given batch size and context length.

    python -m bench.profile [--batch 1 8 32] [--context 64] [--steps 20] [--dtype auto]
                            [--thread-policy fixed] [--ops 12] [--isa native]

For each batch size: B requests with --context-token prompts are prefilled,
then --steps decode steps are timed by phase (schedule, prepare inputs,
forward, sample, update/outputs: the engine's own StepTimings) and one more
window runs under torch.profiler to name the operators behind "forward".
Prints medians and the top operators; writes bench/reports/profile.{json,png}.
``--isa`` caps the CPU tier (the engine's ``cpu_isa``: our kernels, and ATen's and
oneDNN's switches before torch computes anything), to profile a lower tier on a
higher CPU; the report says which tier ran and whether it was capped.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from bench.report import machine_facts, save_report
from engine_svc.core import STEP_PHASES, EngineConfig, LLMEngine, SamplingParams, SchedulerConfig
from engine_svc.models import cpu_kernels, cpu_tier


def profile_batch(
    engine: LLMEngine, batch: int, context: int, steps: int, num_ops: int, tag: str
) -> dict[str, Any]:
    rng = random.Random(batch)
    # the first prompts decode while later ones prefill: room for those steps too
    prefill_steps = -(-batch * context // engine.config.scheduler.max_num_batched_tokens)
    for i in range(batch):
        prompt = [rng.randrange(100, 40000) for _ in range(context)]
        params = SamplingParams(max_tokens=2 * steps + 8 + prefill_steps, ignore_eos=True)
        assert engine.add_request(f"{tag}-{batch}-{i}", prompt, params)
    while engine.scheduler.waiting or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running
    ):
        engine.step()  # prefill everything first: only decode steps are measured
    timings = []
    for _ in range(steps):
        engine.step()
        t = engine.last_step_timings
        assert t is not None
        assert t.num_decodes == batch
        timings.append(t)
    with torch.profiler.profile() as prof:
        for _ in range(min(steps, 5)):
            engine.step()
    for rid in list(engine.scheduler.requests):
        engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()
    phases = {p: 1e3 * statistics.median(getattr(t, p) for t in timings) for p in STEP_PHASES}
    total = 1e3 * statistics.median(sum(t.phases().values()) for t in timings)
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    all_self = sum(e.self_cpu_time_total for e in events) or 1.0
    ops = [
        {
            "op": e.key,
            "calls_per_step": e.count / min(steps, 5),
            "share": e.self_cpu_time_total / all_self,
        }
        for e in events[:num_ops]
    ]
    return {
        "batch": batch,
        "context": context,
        "step_ms": total,
        "phases_ms": phases,
        "tok_per_s": batch / (total / 1e3),
        "top_ops": ops,
    }


def plot(results: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    labels = [f"B={r['batch']}" for r in results]
    bottom = [0.0] * len(results)
    for phase in STEP_PHASES:
        vals = [r["phases_ms"][phase] for r in results]
        ax.bar(labels, vals, bottom=bottom, label=phase)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    for i, r in enumerate(results):
        ax.annotate(
            f"{r['step_ms']:.1f} ms\n{r['tok_per_s']:.0f} tok/s",
            (i, bottom[i]),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.set_ylabel("ms per decode step (median)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="auto | bfloat16 | float32 | fp8 (the engine's kv_cache_dtype)",
    )
    ap.add_argument(
        "--thread-policy",
        default="fixed",
        help="fixed (default: every step on all threads, so profiles compare) | adaptive",
    )
    ap.add_argument("--ops", type=int, default=12, help="top operators to list")
    ap.add_argument("--out", default="profile")
    ap.add_argument(
        "--isa",
        default="native",
        help="cap the CPU tier: native | avx512_bf16 | avx512 | avx2 (the engine's cpu_isa)",
    )
    args = ap.parse_args(argv)
    cpu_tier.apply_cap(args.isa)  # before torch's first op: it reads its switches once
    engine = LLMEngine(
        EngineConfig(
            cpu_isa=args.isa,
            dtype=args.dtype,
            kv_cache_dtype=args.kv_cache_dtype,
            thread_policy=args.thread_policy,
            kv_cache_memory_bytes=2 << 30,
            scheduler=SchedulerConfig(max_num_seqs=max(args.batch)),
            enable_prefix_caching=False,
        )
    )
    facts = machine_facts()
    results = []
    for batch in tqdm(args.batch, desc="profile", unit="batch"):
        results.append(profile_batch(engine, batch, args.context, args.steps, args.ops, "prof"))
    print(f"\n{engine.compute_description}; context {args.context}; {facts['cpu']}")
    print(f"{'batch':>5}{'step ms':>9}{'tok/s':>8}" + "".join(f"{p:>10}" for p in STEP_PHASES))
    for r in results:
        print(
            f"{r['batch']:>5}{r['step_ms']:>9.2f}{r['tok_per_s']:>8.0f}"
            + "".join(f"{r['phases_ms'][p]:>10.2f}" for p in STEP_PHASES)
        )
    for r in results:
        print(f"\nB={r['batch']}: top operators (share of profiled CPU time, calls per step)")
        for op in r["top_ops"]:
            print(f"  {op['share']:6.1%}  {op['calls_per_step']:6.0f}  {op['op']}")
    report = {
        "bench": "profile",
        "machine": facts,
        "compute": engine.compute_description,
        "threads": torch.get_num_threads(),
        "tier": asdict(cpu_tier.report(cpu_kernels.kernel_tier())),
        "context": args.context,
        "results": results,
    }
    title = f"{engine.compute_description}\n{facts['cpu']}, context {args.context}"
    save_report(args.out, report, lambda p: plot(results, p, title))
    return 0


if __name__ == "__main__":
    sys.exit(main())
