"""Prefill attention: the fused kernel vs the SDPA path, per chunk, side by side.

    python -m bench.prefill_attention_bench [--threads 1] [--rounds 15]

Each case is one step's prefill chunks (cached tokens before each chunk, chunk
lengths) over a paged bf16 cache with shuffled blocks, SmolLM2's heads (9 query,
3 KV, 64 dims), q in the dtype the kernel built here takes (bf16 on AMX or
AVX512-BF16, fp32 on AVX2: ``ops.prefill_kernel_dtype``; run under a tier cap,
``LLM_ENGINE_CORE_CPU_ISA=avx2`` with ``ATEN_CPU_CAPABILITY=avx2``, to measure the
fp32 kernel on a bigger CPU). Both sides attend the same rows: the kernel reads the context
through the block table; the SDPA path is the engine's own fallback
(``attention._prefill_attention``: a fresh prompt attends its own K/V, a chunk
with cached context gathers it and masks). Timed in interleaved rounds, best of
each (``timing.compare_ms``), so a busy moment hits both sides. Prints a table
with the ratio and the largest difference between the two outputs, and writes
``bench/reports/prefill_attention.json`` (+ .png) with the machine facts.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch

from bench.report import machine_facts, save_report
from engine_svc.models import cpu_kernels, ops, timing
from engine_svc.models.attention import _prefill_attention, build_attention_metadata

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
CASES: list[tuple[str, list[int], list[int]]] = [
    ("512 fresh", [0], [512]),
    ("2048 fresh", [0], [2048]),
    ("512 after 512", [512], [512]),
    ("512 after 1536", [1536], [512]),
    ("4 x 128 fresh", [0, 0, 0, 0], [128, 128, 128, 128]),
    ("128 after 1200", [1200], [128]),
    ("32 x 32 fresh", [0] * 32, [32] * 32),
    ("1 after 2047", [2047], [1]),
]


def _case(computed: list[int], lens: list[int], rounds: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    ctx = [c + n for c, n in zip(computed, lens, strict=True)]
    nblk = [-(-n // BLOCK) for n in ctx]
    num_blocks = sum(nblk) + 1
    shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, generator=g).to(torch.bfloat16)
    v_cache = torch.randn(shape, generator=g).to(torch.bfloat16)
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    tables, used = [], 0
    for b in nblk:
        tables.append(perm[used : used + b])
        used += b
    meta, _ = build_attention_metadata(computed, lens, tables, 0, BLOCK, torch.device("cpu"))
    total = sum(lens)
    qkv = torch.randn(total, HEADS + 2 * KV_HEADS, HEAD_DIM, generator=g).to(torch.bfloat16)
    q, k, v = qkv[:, :HEADS], qkv[:, HEADS : HEADS + KV_HEADS], qkv[:, HEADS + KV_HEADS :]
    for cache, new in ((k_cache, k), (v_cache, v)):  # the chunks' own K/V, as the step writes
        cache.view(-1, KV_HEADS, HEAD_DIM).index_copy_(0, meta.slot_mapping, new)
    dtype = ops.prefill_kernel_dtype() or torch.bfloat16  # both sides in the kernel's dtype
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    assert meta.prefill_seqs is not None
    assert meta.prefill_tables is not None
    seqs, tabs = meta.prefill_seqs, meta.prefill_tables
    runs = {
        "fused": lambda: ops.prefill_attention(q, k_cache, v_cache, seqs, tabs),
        "sdpa": lambda: _prefill_attention(q, k, v, k_cache, v_cache, meta),
    }
    diff = float((runs["fused"]().float() - runs["sdpa"]().float()).abs().max())
    ms = timing.compare_ms(runs, rounds=rounds)
    return {"fused_ms": ms["fused"], "sdpa_ms": ms["sdpa"], "ratio": ms["sdpa"] / ms["fused"],
            "max_abs_diff": diff}  # fmt: skip


def _chart(rows: list[dict[str, Any]]) -> Any:
    def draw(path: Any) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(9, 4))
        names = [r["case"] for r in rows]
        ax.barh(names, [r["ratio"] for r in rows], color="tab:green")
        ax.axvline(1.0, color="grey", lw=1)
        ax.set_xlabel("SDPA path time / fused kernel time (higher = kernel faster)")
        ax.set_title("Prefill attention per chunk, best of interleaved rounds")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)

    return draw


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    p.add_argument("--rounds", type=int, default=15)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    q = torch.empty(1, HEADS, HEAD_DIM, dtype=torch.bfloat16)
    cache = torch.empty(1, BLOCK, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16)
    if not (cpu_kernels.ops_available() and ops.prefill_kernel_usable(q, cache, None)):
        print("skipped: the fused prefill kernel needs AVX2 (fp32) or AVX512-BF16 and a compiler")
        return 0
    before = machine_facts()["loadavg"]
    units = ops.prefill_kernel_label()
    print(f"fused kernel on {units} (kernels built for tier {cpu_kernels.kernel_tier()!r})")
    rows = []
    print(f"{'case':>16} {'fused ms':>9} {'sdpa ms':>9} {'ratio':>6} {'max |diff|':>10}")
    for name, computed, lens in CASES:
        r = {"case": name, "computed": computed, "lens": lens, **_case(computed, lens, args.rounds)}
        rows.append(r)
        print(f"{name:>16} {r['fused_ms']:9.2f} {r['sdpa_ms']:9.2f} {r['ratio']:5.2f}x "
              f"{r['max_abs_diff']:10.4f}")  # fmt: skip
    report = {"bench": "prefill_attention", "rounds": args.rounds, "cases": rows, "kernel": units,
              "machine": {"loadavg_before": before}}  # fmt: skip
    save_report("prefill_attention", report, _chart(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
