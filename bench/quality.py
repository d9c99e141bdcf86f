"""Quantization quality: perplexity and greedy agreement per precision mode.

    python -m bench.quality [--max-tokens 4096] [--new-tokens 32] [--modes fp32,default]
                            [--isa native,avx512,avx2]

Modes: fp32, default (the stack's engine config: dtype, KV dtype and prefill
attention chosen for this CPU), bf16, fp8-KV (bf16 weights), fp8-weights, both. Perplexity runs
over tests/data/quality/*.txt (public-domain US founding documents) in
128-token chunks through the paged cache, so every chunk after the first reads
the (possibly FP8) KV cache. Greedy agreement: each mode's continuation of a
fixed prompt set against fp32 (mean first-divergence position, exact-match
rate). Writes bench/reports/quality.json and a markdown table on stdout.

``--isa`` runs the modes once per CPU tier cap (``engine_svc.models.cpu_tier``), each
in a process of its own started with the cap's environment (our kernels, ATen and
oneDNN capped alike, as bench.peers does), so ``default`` is what the engine would
choose on a CPU of that tier; the report then holds one result set per tier (the
deltas against that tier's own fp32) and says which tiers are capped rather than
this CPU's own. Each mode's ``compute`` is the engine's own account of what it ran.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from engine_svc.core import EngineConfig, LLMEngine, SamplingParams
from engine_svc.models import cpu_tier
from engine_svc.models.attention import build_attention_metadata

DATA = Path(__file__).resolve().parents[1] / "tests" / "data" / "quality"
REPORT = Path(__file__).resolve().parent / "reports" / "quality.json"
MODES: dict[str, dict[str, str]] = {
    "fp32": {"dtype": "float32", "kv_cache_dtype": "float32"},  # the reference: fp32 throughout
    # what `make run` serves: dtype, KV and prefill attention chosen for this CPU
    "default": {"dtype": "auto"},
    "bf16": {"dtype": "bfloat16"},
    "fp8-kv": {"dtype": "bfloat16", "kv_cache_dtype": "fp8"},
    "fp8-weights": {"dtype": "bfloat16", "quantization": "fp8"},
    "fp8-both": {"dtype": "bfloat16", "quantization": "fp8", "kv_cache_dtype": "fp8"},
}
CHUNK = 128


def make_engine(model_dir: str, mode: str) -> LLMEngine:
    """A CPU engine in one of ``MODES``, within this process's tier cap
    (``$LLM_ENGINE_CORE_CPU_ISA``)."""
    m = MODES[mode]
    cfg = EngineConfig(model_dir=model_dir, device="cpu", num_kv_blocks=320, dtype=m["dtype"])
    cfg.cpu_isa = cpu_tier.requested_cap()
    cfg.kv_cache_dtype = m.get("kv_cache_dtype", "auto")
    cfg.quantization = m.get("quantization", "none")
    return LLMEngine(cfg)


def text_token_ids(engine: LLMEngine, max_tokens: int) -> list[list[int]]:
    """Each text file tokenized (with the model's tokenizer), capped to ``max_tokens`` in all."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(engine.model_dir) / "tokenizer.json"))
    out, left = [], max_tokens
    for f in sorted(DATA.glob("*.txt")):
        ids = tok.encode(f.read_text()).ids[:left]
        out.append(ids)
        left -= len(ids)
    return [ids for ids in out if len(ids) > 1]


@torch.inference_mode()
def perplexity(engine: LLMEngine, docs: list[list[int]]) -> float:
    """exp(mean NLL) of every token after the first, fed in cached chunks."""
    runner, model = engine.runner, engine.model
    bs = engine.config.block_size
    nll, count = 0.0, 0
    for ids in docs:
        table = list(range(-(-len(ids) // bs)))
        for start in range(0, len(ids) - 1, CHUNK):
            chunk = ids[start : start + CHUNK]
            meta, pos = build_attention_metadata(
                [start], [len(chunk)], [table], 0, bs, engine.device
            )
            meta.prefill_dtype = model.prefill_attn_dtype  # as the engine's own steps run
            meta.prefill_kernel = model.prefill_attn_kernel
            x = torch.tensor(chunk, dtype=torch.long)
            hidden = model.forward(x, pos, meta, runner.kv_caches, runner.kv_scales)
            logp = torch.log_softmax(model.compute_logits(hidden), dim=-1)
            targets = ids[start + 1 : start + 1 + len(chunk)]
            rows = logp[: len(targets)].gather(1, torch.tensor(targets)[:, None])
            nll -= float(rows.sum())
            count += len(targets)
    return math.exp(nll / count)


def greedy(engine: LLMEngine, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Greedy continuations of ``prompts``, batched."""
    for i, p in enumerate(prompts):
        engine.add_request(f"q{i}", p, SamplingParams(max_tokens=n, ignore_eos=True))
    got: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
    return [got[f"q{i}"] for i in range(len(prompts))]


def agreement(ref: list[list[int]], got: list[list[int]]) -> dict[str, float]:
    """Mean first-divergence position and exact-match rate of ``got`` against ``ref``."""
    firsts = []
    for a, b in zip(ref, got, strict=True):
        firsts.append(
            next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a))
        )
    exact = sum(a == b for a, b in zip(ref, got, strict=True)) / len(ref)
    return {"mean_first_divergence": statistics.fmean(firsts), "exact_match_rate": exact}


def evaluate(model_dir: str, modes: list[str], max_tokens: int, new_tokens: int) -> dict[str, Any]:
    """Perplexity and agreement per mode (agreement against the first mode)."""
    results: dict[str, Any] = {}
    ref: list[list[int]] | None = None
    for mode in tqdm(modes, desc="modes"):
        engine = make_engine(model_dir, mode)
        docs = text_token_ids(engine, max_tokens)
        prompts = [d[i : i + 24] for d in docs for i in range(0, 4 * 97, 97)]
        out = greedy(engine, prompts, new_tokens)
        ref = ref or out
        results[mode] = {"perplexity": perplexity(engine, docs), **agreement(ref, out)}
        results[mode]["num_tokens"] = sum(len(d) for d in docs)
        results[mode]["compute"] = engine.compute_description
    return results


def evaluate_capped(args: argparse.Namespace, model_dir: str, isa: str) -> dict[str, Any]:
    """``evaluate`` in a child process under the tier cap ``isa`` (torch reads its caps
    once, at start); its results, the tier it ran and whether that is capped."""
    out = Path(tempfile.mkstemp(suffix=f"-quality-{isa}.json")[1])
    cmd = [sys.executable, "-m", "bench.quality", "--model-dir", model_dir, "--json-out", str(out)]
    cmd += ["--max-tokens", str(args.max_tokens), "--new-tokens", str(args.new_tokens)]
    cmd += ["--modes", args.modes]
    subprocess.run(cmd, env=os.environ | cpu_tier.cap_env(isa), check=True)
    results: dict[str, Any] = json.loads(out.read_text())
    out.unlink()
    native = cpu_tier.native_tier()
    tier = cpu_tier.capped(native, isa)
    return {"tier": tier, "capped": tier != native, "cpu_tier": native, "modes": results}


def print_table(tiers: dict[str, dict[str, Any]]) -> None:
    """The markdown table: per tier and mode, perplexity against that tier's fp32 (or the
    first mode run) and greedy agreement."""
    print("| tier | mode | perplexity | vs fp32 | first divergence (mean) | exact match |")
    print("|---|---|---|---|---|---|")
    for t in tiers.values():
        label = f"{t['tier']} (capped, cpu {t['cpu_tier']})" if t["capped"] else t["tier"]
        res = t["modes"]
        base = res.get("fp32", next(iter(res.values())))["perplexity"]
        for mode, r in res.items():
            print(
                f"| {label} | {mode} | {r['perplexity']:.3f} "
                f"| {100 * (r['perplexity'] / base - 1):+.2f}% "
                f"| {r['mean_first_divergence']:.1f} | {r['exact_match_rate']:.0%} |"
            )


def main() -> None:
    """CLI entry point."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model-dir", default="")
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument(
        "--modes", default=",".join(MODES), help=f"comma-separated, from {', '.join(MODES)}"
    )
    ap.add_argument(
        "--isa",
        default="",
        help=f"comma-separated CPU tier caps, from {', '.join(cpu_tier.CAPS)}: the modes run "
        "once per cap, each in its own process (default: this process, uncapped)",
    )
    ap.add_argument("--json-out", default="", help=argparse.SUPPRESS)  # a capped child's output
    args = ap.parse_args()
    from common.config import default_model_dir

    model_dir = args.model_dir or str(default_model_dir())
    modes = args.modes.split(",")
    if not set(modes) <= set(MODES):
        ap.error(f"unknown mode(s) in {modes}; choose from {list(MODES)}")
    if args.json_out:
        Path(args.json_out).write_text(
            json.dumps(evaluate(model_dir, modes, args.max_tokens, args.new_tokens))
        )
        return
    torch.set_num_threads(max(1, torch.get_num_threads()))
    if args.isa:
        tiers = {isa: evaluate_capped(args, model_dir, isa) for isa in args.isa.split(",")}
        report: dict[str, Any] = {"tiers": tiers, "loadavg_end": os.getloadavg()}
    else:
        tier = cpu_tier.native_tier()
        res = evaluate(model_dir, modes, args.max_tokens, args.new_tokens)
        tiers = {"native": {"tier": tier, "capped": False, "cpu_tier": tier, "modes": res}}
        report = res
    REPORT.parent.mkdir(parents=True, exist_ok=True)
    REPORT.write_text(json.dumps(report, indent=2))
    print_table(tiers)


if __name__ == "__main__":
    main()
