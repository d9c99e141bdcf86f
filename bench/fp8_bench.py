"""FP8 KV cache and FP8 weights vs the default dtypes, side by side in one run.

    python -m bench.fp8_bench [--kv-mib 256] [--context 2048] [--runs 3] [--new-tokens 32]

Figures:
  (a) KV capacity at a fixed budget (``kv_cache_memory_bytes``): blocks in the pool,
      bytes per token, and max concurrent ``--context``-token sequences computed
      from the pool (the engine's own ``determine_num_blocks``). Verified by
      admitting sequences into a real in-process engine until the scheduler can't
      (see ``admit``), at a smaller budget with shorter prompts (``--verify-mib``,
      ``--verify-context``) so it stays fast on CPU: filling the 256 MiB fp8 pool
      would mean prefilling ~23k tokens. The 2k figure is extrapolated with the
      formula the admission run confirms. Measured for the KV dtype
      the engine uses on CPU (``auto`` = fp32, attention stays fp32 on CPU) and for
      ``fp8``; bf16 (what ``auto`` is on CUDA) is computed from the same formula.
  (b) weight memory and decode tokens/s at batch 1 and 8 (median of ``--runs``),
      ``quantization=none`` (bf16) vs ``fp8``.
Writes bench/reports/fp8_bench.json and fp8_bench.png. Figures are noisy on a
shared 2-core machine: quote ratios from one run.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from bench.report import save_report
from common.config import default_model_dir
from engine_svc.core import EngineConfig, LLMEngine, SamplingParams, SchedulerConfig
from engine_svc.core.model_runner import determine_num_blocks
from engine_svc.models.fp8 import Fp8Weight

MIB = 1 << 20


def weight_bytes(engine: LLMEngine) -> int:
    """Bytes of every distinct weight tensor (tied embeddings counted once, FP8 scales included)."""
    model: Any = engine.model
    seen: set[int] = set()
    total = 0

    def add(t: object) -> None:
        nonlocal total
        if isinstance(t, Fp8Weight):
            total += t.nbytes
        elif isinstance(t, torch.Tensor) and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()

    for name in ("embed_tokens", "norm", "lm_head"):
        add(getattr(model, name))
    for layer in model.layers:
        for slot in type(layer).__slots__:
            add(getattr(layer, slot))
    return total


def admit(engine: LLMEngine, context: int, hold_tokens: int) -> dict[str, int]:
    """Admit ``context``-token prompts until the KV pool is full; count concurrent sequences.

    Submits ``computed + 2`` prompts at once, each generating ``hold_tokens``
    (ignore_eos), long enough that the first is still decoding when the last
    admitted one finishes prefill. The figure is the most requests that, at one
    step, hold a full prompt's KV and are decoding (first token out), counted until
    the first request finishes; the rest are then aborted (that is when the
    extras would start to fit).
    """
    block = engine.config.block_size
    per_seq = -(-(context + hold_tokens) // block)
    computed = engine.runner.num_blocks // per_seq
    rng = random.Random(context)
    n = computed + 2
    for i in range(n):
        prompt = [rng.randrange(100, 40000) for _ in range(context)]
        prompt[0] = 1 + i  # distinct first block: nothing shared by the prefix cache
        params = SamplingParams(max_tokens=hold_tokens, ignore_eos=True)
        assert engine.add_request(f"cap{i}", prompt, params)
    decoding: set[str] = set()
    most = most_running = 0
    finished = False
    while engine.has_unfinished_requests() and not finished:
        for out in engine.step():
            finished |= out.finished
            if out.new_token_ids:
                decoding.add(out.request_id)
        most = max(most, len(decoding))
        most_running = max(most_running, engine.get_stats().num_running)
    # past the first finish, freed blocks go to the extras: capacity is already known
    for i in range(n):
        engine.abort_request(f"cap{i}")
    while engine.has_unfinished_requests():
        engine.step()
    return {
        "seq_blocks": per_seq,
        "computed": computed,
        "verified": most,
        "max_running": most_running,
        "preemptions": engine.get_stats().num_preemptions_total,
    }


def kv_capacity(model_dir: str, kv_dtype: str, args: argparse.Namespace) -> dict[str, Any]:
    """Pool figures at ``--kv-mib`` (the engine's own ``determine_num_blocks``), and an
    admission run at ``--verify-mib`` with ``--verify-context``-token prompts."""
    engine = LLMEngine(
        EngineConfig(
            model_dir=model_dir,
            device="cpu",
            dtype="bfloat16",
            kv_cache_dtype=kv_dtype,
            kv_cache_memory_bytes=args.verify_mib * MIB,
            scheduler=SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=2048),
            max_model_len=args.context + args.hold_tokens + 16,
            enable_prefix_caching=False,
        )
    )
    runner = engine.runner
    dtype = runner.kv_cache.dtype
    block = engine.config.block_size
    full = EngineConfig(kv_cache_memory_bytes=args.kv_mib * MIB, block_size=block)
    blocks = determine_num_blocks(full, engine.model_config, dtype, runner.device)
    per_seq = -(-(args.context + args.hold_tokens) // block)
    out: dict[str, Any] = {
        "kv_dtype": str(dtype).removeprefix("torch."),
        "blocks": blocks,
        "pool_tokens": blocks * block,
        "bytes_per_token": engine.model_config.kv_bytes_per_token(dtype.itemsize),
        "seq_blocks": per_seq,
        "computed": blocks // per_seq,
        "verify_pool_bytes": runner.kv_cache_bytes,
    }
    t0 = time.perf_counter()
    check = admit(engine, args.verify_context, args.hold_tokens)
    out["verify"] = {**check, "seconds": time.perf_counter() - t0}
    out["verify_matches"] = check["verified"] == check["computed"]
    return out


def decode_tps(engine: LLMEngine, batch: int, new_tokens: int, tag: str) -> float:
    rng = random.Random(batch)
    for i in range(batch):
        prompt = [rng.randrange(100, 40000) for _ in range(32)]
        params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
        assert engine.add_request(f"{tag}-{i}", prompt, params)
    # the first step prefills every prompt; time the decode steps after it
    generated = sum(len(o.new_token_ids) for o in engine.step())
    t0 = time.perf_counter()
    decoded = 0
    while engine.has_unfinished_requests():
        decoded += sum(len(o.new_token_ids) for o in engine.step())
    assert generated + decoded == batch * new_tokens
    return decoded / (time.perf_counter() - t0)


def weights_side(
    model_dir: str, quant: str, args: argparse.Namespace, bar: tqdm[Any]
) -> dict[str, Any]:
    engine = LLMEngine(
        EngineConfig(
            model_dir=model_dir,
            device="cpu",
            dtype="bfloat16",
            quantization=quant,
            num_kv_blocks=256,
            enable_prefix_caching=False,
        )
    )
    decode_tps(engine, 1, 8, f"{quant}-warm")
    out: dict[str, Any] = {"weight_bytes": weight_bytes(engine)}
    for batch in (1, 8):
        vals = []
        for r in range(args.runs):
            vals.append(decode_tps(engine, batch, args.new_tokens, f"{quant}-b{batch}-{r}"))
            bar.update(1)
        out[f"decode_b{batch}_tps"] = statistics.median(vals)
        out[f"decode_b{batch}_runs"] = vals
    return out


def write_chart(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(12, 4))
    kv = report["kv"]
    names = [k for k in kv]
    a1.bar(names, [kv[k]["bytes_per_token"] for k in names])
    a1.set_title(f"KV bytes per token ({report['kv_mib']} MiB budget)")
    a2.bar(names, [kv[k]["computed"] for k in names])
    a2.set_title(f"concurrent {report['context']}-token seqs")
    w = report["weights"]
    xs = range(2)
    for i, q in enumerate(w):
        a3.bar(
            [x + 0.4 * i - 0.2 for x in xs],
            [w[q]["decode_b1_tps"], w[q]["decode_b8_tps"]],
            0.4,
            label=f"{q} ({w[q]['weight_bytes'] / MIB:.0f} MiB)",
        )
    a3.set_xticks(list(xs), ["batch 1", "batch 8"])
    a3.set_title("decode tok/s (median)")
    a3.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kv-mib", type=int, default=256, help="KV budget in MiB")
    parser.add_argument("--context", type=int, default=2048, help="prompt tokens per sequence")
    parser.add_argument("--hold-tokens", type=int, default=32, help="decode steps each holds")
    parser.add_argument("--verify-mib", type=int, default=64, help="KV budget of the admission run")
    parser.add_argument(
        "--verify-context", type=int, default=512, help="prompt tokens in the admission run"
    )
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--model-dir", default=str(default_model_dir()))
    args = parser.parse_args()
    model_dir = args.model_dir
    report: dict[str, Any] = {
        "model": Path(model_dir).name,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "kv_mib": args.kv_mib,
        "context": args.context,
        "runs": args.runs,
        "kv": {},
        "weights": {},
    }
    with tqdm(total=2 + 4 * args.runs, desc="fp8 bench", unit="run") as bar:
        for kv_dtype in ("auto", "fp8"):
            bar.set_postfix_str(f"kv {kv_dtype}")
            res = kv_capacity(model_dir, kv_dtype, args)
            report["kv"][res["kv_dtype"]] = res
            bar.update(1)
        # bf16 KV (CUDA's ``auto``) from the same formula the engine uses
        ref = report["kv"]["float8_e4m3fn"]
        bpt = ref["bytes_per_token"] * 2
        blocks = args.kv_mib * MIB // (bpt * 16)
        report["kv"]["bfloat16 (computed)"] = {
            "kv_dtype": "bfloat16",
            "blocks": blocks,
            "pool_tokens": blocks * 16,
            "bytes_per_token": bpt,
            "seq_blocks": ref["seq_blocks"],
            "computed": blocks // ref["seq_blocks"],
        }
        for quant in ("none", "fp8"):
            bar.set_postfix_str(f"weights {quant}")
            report["weights"][quant] = weights_side(model_dir, quant, args, bar)
    w = report["weights"]
    report["ratio"] = {
        "weight_bytes_fp8_over_bf16": w["fp8"]["weight_bytes"] / w["none"]["weight_bytes"],
        "decode_b1_fp8_over_bf16": w["fp8"]["decode_b1_tps"] / w["none"]["decode_b1_tps"],
        "decode_b8_fp8_over_bf16": w["fp8"]["decode_b8_tps"] / w["none"]["decode_b8_tps"],
    }
    print(
        f"\nKV budget {args.kv_mib} MiB, {args.context}-token sequences (+{args.hold_tokens} out)"
    )
    print(f"{'kv dtype':<22}{'blocks':>8}{'tokens':>9}{'B/token':>9}{'max seqs':>10}")
    for name, r in report["kv"].items():
        print(
            f"{name:<22}{r['blocks']:>8}{r['pool_tokens']:>9}{r['bytes_per_token']:>9}"
            f"{r['computed']:>10}"
        )
    print(
        f"admission check at {args.verify_mib} MiB, {args.verify_context}-token prompts "
        "(computed / concurrent in the engine / preemptions):"
    )
    for name, r in report["kv"].items():
        if "verify" in r:
            v = r["verify"]
            print(f"  {name:<20}{v['computed']:>4} /{v['verified']:>4} /{v['preemptions']:>3}")
    print(f"\n{'weights':<10}{'MiB':>8}{'b1 tok/s':>10}{'b8 tok/s':>10}")
    for q, r in w.items():
        print(
            f"{q:<10}{r['weight_bytes'] / MIB:>8.1f}{r['decode_b1_tps']:>10.1f}"
            f"{r['decode_b8_tps']:>10.1f}"
        )
    print("fp8/bf16: " + ", ".join(f"{k} {v:.2f}x" for k, v in report["ratio"].items()))
    save_report("fp8_bench", report, lambda path: write_chart(report, path))


if __name__ == "__main__":
    main()
