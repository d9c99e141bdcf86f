"""Prompt-lookup speculative decoding on vs off, greedy, on two prompt sets.

    python -m bench.spec_bench [--runs 3] [--new-tokens 48] [--prompts 3]

Sets (chat-formatted, one request at a time, batch 1):
  extract: "repeat / quote / extract ... from this text: <passage>" over passages of
           tests/data/quality/*.txt, where the answer copies the prompt and drafts hit
  free:    open-ended questions, where drafts rarely hit
Per set and mode: tokens/s (median of ``--runs``), forward passes (engine steps)
per generated token, acceptance rate (accepted / drafted), speedup on/off. On and
off run interleaved prompt by prompt in one engine (prefix caching off, so both
prefill the same).
With ``--dtype float32`` the greedy outputs must be identical (the run fails
otherwise); in bfloat16 (the default, what the service runs on CPU) they are
reported, not asserted: bf16 matmuls round differently by batch shape, and
these features change shapes, so near-tie argmaxes can flip (measured: identical
in fp32, not in bf16, on the real model).
Writes bench/reports/spec_bench.json and spec_bench.png. Figures are noisy on a
shared 2-core machine: quote ratios from one run.
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
from engine_svc.core import EngineConfig, LLMEngine, SamplingParams

DATA = ROOT / "tests" / "data" / "quality"
SETS = ("extract", "free")
MODES = ("off", "on")
EXTRACT_ASKS = (
    "Repeat the following text word for word.",
    "Quote the first two sentences of this text exactly.",
    "Extract the opening passage of this text verbatim.",
    "Copy out this text exactly as written.",
    "Repeat this passage back to me without changes.",
    "Quote this text exactly, from the beginning.",
)
FREE_QUESTIONS = (
    "Write a short poem about the sea at night.",
    "What are three good habits for staying healthy?",
    "Tell me a story about a robot who learns to paint.",
    "Why is the sky blue? Explain simply.",
    "Give me some ideas for a weekend trip with friends.",
    "What would you do if you could fly for a day?",
)


def chat(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


def prompt_sets(model_dir: str, n: int) -> dict[str, list[list[int]]]:
    """Token ids of ``n`` extraction prompts (real passages) and ``n`` free questions."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    words = " ".join(f.read_text() for f in sorted(DATA.glob("*.txt"))).split()
    extract = []
    for i in range(n):
        passage = " ".join(words[i * 150 : i * 150 + 120])
        ask = EXTRACT_ASKS[i % len(EXTRACT_ASKS)]
        extract.append(tok.encode(chat(f"{ask}\n\nText: {passage}")).ids)
    free = [tok.encode(chat(FREE_QUESTIONS[i % len(FREE_QUESTIONS)])).ids for i in range(n)]
    return {"extract": extract, "free": free}


def generate(
    engine: LLMEngine, rid: str, prompt: list[int], new_tokens: int, spec: bool
) -> tuple[list[int], float, int, int, int]:
    """(output ids, decode seconds, decode steps, drafted, accepted) of one greedy request.

    Decode time and steps start after the prefill step (the first token), which is
    the same work either way.
    """
    assert engine.add_request(rid, prompt, SamplingParams(max_tokens=new_tokens), speculative=spec)
    out: list[int] = []
    drafted = accepted = 0
    t0 = 0.0
    steps0 = 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            if not out and o.new_token_ids:
                t0, steps0 = time.perf_counter(), engine.get_stats().num_steps_total
            out.extend(o.new_token_ids)
            drafted, accepted = o.num_draft_tokens, o.num_accepted_tokens
    elapsed = time.perf_counter() - t0
    steps = engine.get_stats().num_steps_total - steps0
    return out, elapsed, steps, drafted, accepted


def write_chart(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    xs = range(len(SETS))
    for i, mode in enumerate(MODES):
        off = 0.4 * i - 0.2
        a1.bar(
            [x + off for x in xs], [report[s][mode]["tps"] for s in SETS], 0.4, label=f"spec {mode}"
        )
        a2.bar(
            [x + off for x in xs],
            [report[s][mode]["steps_per_token"] for s in SETS],
            0.4,
            label=f"spec {mode}",
        )
    for s_i, s in enumerate(SETS):
        a1.annotate(
            f"{report[s]['speedup']:.2f}x", (s_i + 0.2, report[s]["on"]["tps"]), ha="center"
        )
    a1.set_title("decode tok/s (median), batch 1")
    a2.set_title("forward passes per generated token")
    for ax in (a1, a2):
        ax.set_xticks(list(xs), list(SETS))
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--prompts", type=int, default=3, help="prompts per set")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--model-dir", default=str(default_model_dir()))
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = parser.parse_args()
    engine = LLMEngine(
        EngineConfig(
            model_dir=args.model_dir,
            device="cpu",
            dtype=args.dtype,
            num_kv_blocks=256,
            enable_prefix_caching=False,
            num_speculative_tokens=args.k,
        )
    )
    sets = prompt_sets(args.model_dir, args.prompts)
    generate(engine, "warm", sets["free"][0], 8, True)
    report: dict[str, Any] = {
        "model": Path(args.model_dir).name,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "runs": args.runs,
        "new_tokens": args.new_tokens,
        "prompts_per_set": args.prompts,
        "num_speculative_tokens": args.k,
        "prompt_lookup": [engine.config.prompt_lookup_min, engine.config.prompt_lookup_max],
    }
    identical = True
    total = len(SETS) * args.runs * args.prompts * len(MODES)
    with tqdm(total=total, desc="spec bench", unit="req") as bar:
        for s in SETS:
            tps: dict[str, list[float]] = {m: [] for m in MODES}
            agg = {m: {"tokens": 0, "steps": 0, "drafted": 0, "accepted": 0} for m in MODES}
            for r in range(args.runs):
                secs = dict.fromkeys(MODES, 0.0)
                toks = dict.fromkeys(MODES, 0)
                for i, prompt in enumerate(sets[s]):
                    outs = {}
                    for m in MODES if (r + i) % 2 == 0 else MODES[::-1]:
                        bar.set_postfix_str(f"{s} spec {m}")
                        out, sec, steps, drafted, accepted = generate(
                            engine, f"{s}-{r}-{i}-{m}", prompt, args.new_tokens, m == "on"
                        )
                        outs[m] = out
                        secs[m] += sec
                        toks[m] += len(out) - 1
                        a = agg[m]
                        a["tokens"] += len(out) - 1
                        a["steps"] += steps
                        a["drafted"] += drafted
                        a["accepted"] += accepted
                        bar.update(1)
                    identical &= outs["on"] == outs["off"]
                for m in MODES:
                    tps[m].append(toks[m] / secs[m])
            report[s] = {}
            for m in MODES:
                a = agg[m]
                report[s][m] = {
                    "tps": statistics.median(tps[m]),
                    "tps_runs": tps[m],
                    "steps_per_token": a["steps"] / a["tokens"],
                    "acceptance": a["accepted"] / a["drafted"] if a["drafted"] else 0.0,
                    **a,
                }
            report[s]["speedup"] = report[s]["on"]["tps"] / report[s]["off"]["tps"]
    report["outputs_identical"] = identical
    report["free_slowdown_within_10pct"] = report["free"]["speedup"] >= 0.9
    print(
        f"\n{'set':<9}{'spec':>5}{'tok/s':>8}{'steps/tok':>11}{'drafted':>9}"
        f"{'accepted':>10}{'accept %':>10}{'speedup':>9}"
    )
    for s in SETS:
        for m in MODES:
            r_ = report[s][m]
            sp = f"{report[s]['speedup']:.2f}x" if m == "on" else ""
            print(
                f"{s:<9}{m:>5}{r_['tps']:>8.1f}{r_['steps_per_token']:>11.3f}{r_['drafted']:>9}"
                f"{r_['accepted']:>10}{r_['acceptance']:>10.1%}{sp:>9}"
            )
    print(f"greedy outputs identical on/off: {identical}")
    print(f"free generation slowdown within 10%: {report['free_slowdown_within_10pct']}")
    save_report("spec_bench", report, lambda path: write_chart(report, path))
    if args.dtype == "float32" and not identical:
        raise SystemExit("speculative decoding changed greedy outputs in float32")


if __name__ == "__main__":
    main()
