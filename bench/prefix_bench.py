"""Prefix caching off vs on where every request shares a 512-token system prompt.

    python -m bench.prefix_bench [--num-requests 12] [--system-tokens 512] [--new-tokens 8]

Each request is the shared system prompt (real text from tests/data/quality) plus
a short distinct user suffix. Two engines (``enable_prefix_caching`` False / True),
two arrival patterns each:
  sequential: one request at a time, each runs to completion before the next
  batch:      all requests added at once
The sequential and batch runs use different system prompts, so the batch run
never hits blocks the sequential run cached. Figures per (cache, pattern): TTFT
p50 (engine timestamps ``first_token_time - arrival_time``), prefill tokens
actually computed (prompt tokens - ``num_cached_tokens``), cache hit rate (hit
over queried tokens, from ``EngineStats``), wall time; ratio on/off.
Then, on the caching engine, the cross-tenant check (``cross_tenant``): per round a
fresh shared prompt is sent by tenant A (cold), then by A again and by tenant B (each
request salted with its tenant, as the gateway salts them), in alternating order;
B's TTFT must match a cold prompt's (no timing oracle) and B must get no cached
tokens (the run fails otherwise), while A's repeat hits.
With ``--dtype float32`` the greedy outputs must be identical (the run fails
otherwise); in bfloat16 (the default, what the service runs on CPU) they are
reported, not asserted: bf16 matmuls round differently by batch shape, and
these features change shapes, so near-tie argmaxes can flip (measured: identical
in fp32, not in bf16, on the real model).
Writes bench/reports/prefix_bench.json and prefix_bench.png. Figures are noisy
on a shared 2-core machine: quote ratios from one run.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from bench.report import save_report
from common.config import ROOT, default_model_dir
from engine_svc.core import EngineConfig, LLMEngine, RequestOutput, SamplingParams, SchedulerConfig

DATA = ROOT / "tests" / "data" / "quality"
PATTERNS = ("sequential", "batch")


def workload(model_dir: str, system_tokens: int, n: int) -> dict[str, list[list[int]]]:
    """Per pattern: ``n`` prompts = one shared system prompt + a distinct user suffix."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    text = " ".join(f.read_text() for f in sorted(DATA.glob("*.txt")))
    ids = tok.encode(text).ids
    out: dict[str, list[list[int]]] = {}
    for k, pattern in enumerate(PATTERNS):
        system = ids[k * system_tokens : (k + 1) * system_tokens]
        assert len(system) == system_tokens, "not enough text for the system prompts"
        out[pattern] = [
            system + tok.encode(f"\nUser {i}: summarize article {i + 1} in one line.").ids
            for i in range(n)
        ]
    return out


def run(
    engine: LLMEngine, prompts: list[list[int]], pattern: str, new_tokens: int
) -> dict[str, Any]:
    before = engine.get_stats()
    finals: dict[str, RequestOutput] = {}
    tokens: dict[str, list[int]] = {}
    params = SamplingParams(max_tokens=new_tokens)

    def drain() -> None:
        while engine.has_unfinished_requests():
            for o in engine.step():
                tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finished:
                    finals[o.request_id] = o

    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        assert engine.add_request(f"{pattern}-{i}", p, params)
        if pattern == "sequential":
            drain()
    drain()
    wall = time.perf_counter() - t0
    after = engine.get_stats()
    outs = [finals[f"{pattern}-{i}"] for i in range(len(prompts))]
    ttft = [(o.first_token_time or o.arrival_time) - o.arrival_time for o in outs]
    queries = after.prefix_cache_queries - before.prefix_cache_queries
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    return {
        "ttft_p50_ms": 1000 * statistics.median(ttft),
        "ttft_max_ms": 1000 * max(ttft),
        "prompt_tokens": sum(o.num_prompt_tokens for o in outs),
        "prefill_computed": sum(o.num_prompt_tokens - o.num_cached_tokens for o in outs),
        "cached_tokens": sum(o.num_cached_tokens for o in outs),
        "hit_rate": hits / queries if queries else 0.0,
        "wall_s": wall,
        "outputs": [tokens[f"{pattern}-{i}"] for i in range(len(prompts))],
    }


def cross_tenant(
    engine: LLMEngine, system: list[int], rounds: int, new_tokens: int
) -> dict[str, Any]:
    """TTFT and cached tokens of a cold prompt (tenant A), A's repeat and tenant B's
    copy, each round on a prompt no earlier round sent (a distinct first token)."""
    params = SamplingParams(max_tokens=new_tokens)
    ttft: dict[str, list[float]] = {"cold": [], "same_tenant": [], "other_tenant": []}
    cached: dict[str, list[int]] = {k: [] for k in ttft}

    def one(rid: str, prompt: list[int], salt: str) -> RequestOutput:
        assert engine.add_request(rid, prompt, params, cache_salt=salt)
        final = None
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    final = o
        assert final is not None
        return final

    for r in range(rounds):
        prompt = [2000 + r, *system]
        sides = [("same_tenant", "tenant:a", 1), ("other_tenant", "tenant:b", 2)]
        for side, salt, k in [("cold", "tenant:a", 0), *(sides if r % 2 == 0 else sides[::-1])]:
            out = one(f"x{r}-{side}", [*prompt, 500 + k], salt)
            ttft[side].append((out.first_token_time or out.arrival_time) - out.arrival_time)
            cached[side].append(out.num_cached_tokens)
    p50 = {k: 1000 * statistics.median(v) for k, v in ttft.items()}
    return {
        "rounds": rounds,
        "ttft_p50_ms": p50,
        "cached_tokens_p50": {k: statistics.median(v) for k, v in cached.items()},
        "other_over_cold": p50["other_tenant"] / p50["cold"],
        "same_over_cold": p50["same_tenant"] / p50["cold"],
        "other_tenant_cached_max": max(cached["other_tenant"]),
    }


def write_chart(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    xs = range(len(PATTERNS))
    for i, side in enumerate(("off", "on")):
        r = report[side]
        off = 0.4 * i - 0.2
        a1.bar([x + off for x in xs], [r[p]["ttft_p50_ms"] for p in PATTERNS], 0.4, label=side)
        a2.bar([x + off for x in xs], [r[p]["prefill_computed"] for p in PATTERNS], 0.4, label=side)
    for ax, title in ((a1, "TTFT p50 (ms)"), (a2, "prefill tokens computed")):
        ax.set_xticks(list(xs), list(PATTERNS))
        ax.set_title(title)
        ax.legend(title="prefix cache")
    fig.suptitle(
        f"{report['num_requests']} requests sharing a {report['system_tokens']}-token system prompt"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=12)
    parser.add_argument("--system-tokens", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--model-dir", default=str(default_model_dir()))
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = parser.parse_args()
    prompts = workload(args.model_dir, args.system_tokens, args.num_requests)
    report: dict[str, Any] = {
        "model": Path(args.model_dir).name,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "num_requests": args.num_requests,
        "system_tokens": args.system_tokens,
        "new_tokens": args.new_tokens,
    }
    with tqdm(total=5, desc="prefix bench", unit="run") as bar:
        for side, caching in (("off", False), ("on", True)):
            engine = LLMEngine(
                EngineConfig(
                    model_dir=args.model_dir,
                    device="cpu",
                    dtype=args.dtype,
                    num_kv_blocks=1024,
                    scheduler=SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=512),
                    enable_prefix_caching=caching,
                )
            )
            warm = SamplingParams(max_tokens=2)
            assert engine.add_request("warm", list(range(1000, 1040)), warm)
            while engine.has_unfinished_requests():
                engine.step()
            report[side] = {}
            for pattern in PATTERNS:
                bar.set_postfix_str(f"cache {side}, {pattern}")
                report[side][pattern] = run(engine, prompts[pattern], pattern, args.new_tokens)
                bar.update(1)
        bar.set_postfix_str("cache on, cross-tenant")
        system = prompts["sequential"][0][: args.system_tokens]
        report["cross_tenant"] = cross_tenant(engine, system, args.num_requests, args.new_tokens)
        bar.update(1)
    identical = all(report["off"][p]["outputs"] == report["on"][p]["outputs"] for p in PATTERNS)
    report["outputs_identical"] = identical
    report["ratio_on_over_off"] = {
        p: {
            k: report["on"][p][k] / report["off"][p][k]
            for k in ("ttft_p50_ms", "prefill_computed", "wall_s")
        }
        for p in PATTERNS
    }
    for side in ("off", "on"):
        for p in PATTERNS:
            report[side][p].pop("outputs")
    print(
        f"\n{'pattern':<12}{'cache':>6}{'TTFT p50 ms':>13}{'prefill computed':>18}"
        f"{'/ prompt':>10}{'hit rate':>10}{'wall s':>8}"
    )
    for p in PATTERNS:
        for side in ("off", "on"):
            r = report[side][p]
            print(
                f"{p:<12}{side:>6}{r['ttft_p50_ms']:>13.1f}{r['prefill_computed']:>18}"
                f"{r['prompt_tokens']:>10}{r['hit_rate']:>10.1%}{r['wall_s']:>8.2f}"
            )
        ratio = report["ratio_on_over_off"][p]
        print(
            f"{p:<12}{'on/off':>6}{ratio['ttft_p50_ms']:>12.2f}x"
            f"{ratio['prefill_computed']:>17.2f}x{'':>20}{ratio['wall_s']:>7.2f}x"
        )
    print(f"greedy outputs identical with and without caching: {identical}")
    x = report["cross_tenant"]
    print(
        f"cross-tenant ({x['rounds']} rounds): TTFT p50 cold {x['ttft_p50_ms']['cold']:.1f} ms, "
        f"same tenant {x['ttft_p50_ms']['same_tenant']:.1f} ms ({x['same_over_cold']:.2f}x), "
        f"other tenant {x['ttft_p50_ms']['other_tenant']:.1f} ms ({x['other_over_cold']:.2f}x); "
        f"cached tokens p50 {x['cached_tokens_p50']}"
    )
    save_report("prefix_bench", report, lambda path: write_chart(report, path))
    if x["other_tenant_cached_max"]:
        raise SystemExit("another tenant's request hit the prefix cache of tenant A's prompt")
    if args.dtype == "float32" and not identical:
        raise SystemExit("prefix caching changed greedy outputs in float32")


if __name__ == "__main__":
    main()
