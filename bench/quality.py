"""Quantization quality: perplexity and greedy agreement per precision mode.

    python -m bench.quality [--max-tokens 4096] [--new-tokens 32]

Modes: fp32, default (the stack's engine config: dtype, KV dtype and prefill
attention chosen for this CPU), bf16, fp8-KV (bf16 weights), fp8-weights, both. Perplexity runs
over tests/data/quality/*.txt (public-domain US founding documents) in
128-token chunks through the paged cache, so every chunk after the first reads
the (possibly FP8) KV cache. Greedy agreement: each mode's continuation of a
fixed prompt set against fp32 (mean first-divergence position, exact-match
rate). Writes bench/reports/quality.json and a markdown table on stdout.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from engine_svc.core import EngineConfig, LLMEngine, SamplingParams
from engine_svc.models.attention import build_attention_metadata

DATA = Path(__file__).resolve().parents[1] / "tests" / "data" / "quality"
REPORT = Path(__file__).resolve().parent / "reports" / "quality.json"
MODES: dict[str, dict[str, str]] = {
    "fp32": {"dtype": "float32"},
    # what `make run` serves: dtype, KV and prefill attention chosen for this CPU
    "default": {"dtype": "auto"},
    "bf16": {"dtype": "bfloat16"},
    "fp8-kv": {"dtype": "bfloat16", "kv_cache_dtype": "fp8"},
    "fp8-weights": {"dtype": "bfloat16", "quantization": "fp8"},
    "fp8-both": {"dtype": "bfloat16", "quantization": "fp8", "kv_cache_dtype": "fp8"},
}
CHUNK = 128


def make_engine(model_dir: str, mode: str) -> LLMEngine:
    """A CPU engine in one of ``MODES``."""
    m = MODES[mode]
    cfg = EngineConfig(model_dir=model_dir, device="cpu", num_kv_blocks=320, dtype=m["dtype"])
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
    return results


def main() -> None:
    """CLI entry point."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model-dir", default="")
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--new-tokens", type=int, default=32)
    args = ap.parse_args()
    from common.config import default_model_dir

    model_dir = args.model_dir or str(default_model_dir())
    torch.set_num_threads(max(1, torch.get_num_threads()))
    res = evaluate(model_dir, list(MODES), args.max_tokens, args.new_tokens)
    REPORT.parent.mkdir(parents=True, exist_ok=True)
    REPORT.write_text(json.dumps(res, indent=2))
    print("| mode | perplexity | Δ vs bf16 | first divergence (mean) | exact match |")
    print("|---|---|---|---|---|")
    base = res["bf16"]["perplexity"]
    for mode, r in res.items():
        print(
            f"| {mode} | {r['perplexity']:.3f} | {100 * (r['perplexity'] / base - 1):+.2f}% "
            f"| {r['mean_first_divergence']:.1f} | {r['exact_match_rate']:.0%} |"
        )


if __name__ == "__main__":
    main()
