"""Native engine vs HF transformers generate() on the real model, side by side.

    python -m bench.engine_bench [--runs 3] [--mixed-runs 1] [--skip-hf] [--num-requests 64]

Figures (median over --runs; the mixed workload over --mixed-runs):
  (a) single-stream decode: 32-token prompt, 128 new tokens, greedy → tokens/s
  (b) prefill: one 512-token prompt → prompt tokens/s
  (c) mixed workload: 64 requests arriving at once, prompts 16–1024 and outputs
      16–256 tokens (log-uniform, fixed seed); ours serves up to 32 at a time,
      transformers runs static left-padded batches of 32 → generated tokens/s
Both sides use bf16 weights; ours keeps attention and KV in fp32 on CPU.
Writes bench/reports/engine_bench.json and engine_bench.png.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from bench.report import save_report
from common.config import default_model_dir
from engine_svc.core import EngineConfig, LLMEngine, SamplingParams, SchedulerConfig

FIGURES = ("decode_1_stream", "prefill_512", "mixed_64")


def mixed_workload(n: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length) pairs, log-uniform lengths (skewed short)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        plen = int(math.exp(rng.uniform(math.log(16), math.log(1024))))
        olen = int(math.exp(rng.uniform(math.log(16), math.log(256))))
        out.append(([rng.randrange(100, 40000) for _ in range(plen)], olen))
        out[-1][0][0] = 1 + i % 7  # distinct starts: no accidental sharing
    return out


def _median(fn: Callable[[], float], runs: int, bar: tqdm[Any]) -> float:
    vals = []
    for _ in range(runs):
        vals.append(fn())
        bar.update(1)
    return statistics.median(vals)


class Ours:
    """The native engine, one instance for every figure."""

    def __init__(self, model_dir: Path) -> None:
        self.engine = LLMEngine(
            EngineConfig(
                model_dir=str(model_dir),
                dtype="bfloat16",
                kv_cache_memory_bytes=3 << 30,
                scheduler=SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=512),
                enable_prefix_caching=False,  # repeated prompts must be recomputed
            )
        )
        self._n = 0

    def _run(self, reqs: list[tuple[list[int], int]]) -> tuple[float, int]:
        for prompt, olen in reqs:
            self._n += 1
            params = SamplingParams(max_tokens=olen, ignore_eos=True)
            assert self.engine.add_request(f"b{self._n}", prompt, params)
        t0 = time.perf_counter()
        generated = 0
        while self.engine.has_unfinished_requests():
            generated += sum(len(o.new_token_ids) for o in self.engine.step())
        return time.perf_counter() - t0, generated

    def decode(self, prompt: list[int], n: int) -> float:
        elapsed, generated = self._run([(prompt, n)])
        return generated / elapsed

    def prefill(self, prompt: list[int]) -> float:
        elapsed, _ = self._run([(prompt, 1)])
        return len(prompt) / elapsed

    def mixed(self, reqs: list[tuple[list[int], int]]) -> float:
        elapsed, generated = self._run(reqs)
        return generated / elapsed


class HF:
    """transformers generate() (bf16 by default), greedy, exactly the requested lengths."""

    def __init__(
        self, model_dir: Path, dtype: torch.dtype = torch.bfloat16, device: str = "cpu"
    ) -> None:
        from transformers import AutoModelForCausalLM

        self.device = torch.device(device)
        self.model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=dtype, device_map=str(self.device)
        )

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def _generate(self, ids: torch.Tensor, mask: torch.Tensor, n: int) -> None:
        self.model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=2,
        )

    def decode(self, prompt: list[int], n: int) -> float:
        ids = torch.tensor([prompt], device=self.device)
        t0 = time.perf_counter()
        self._generate(ids, torch.ones_like(ids), n)
        self._sync()
        return n / (time.perf_counter() - t0)

    @torch.inference_mode()
    def prefill(self, prompt: list[int]) -> float:
        t0 = time.perf_counter()
        self.model(torch.tensor([prompt], device=self.device))
        self._sync()
        return len(prompt) / (time.perf_counter() - t0)

    def mixed(self, reqs: list[tuple[list[int], int]], batch: int = 32) -> float:
        elapsed, useful = self.run(reqs, batch)
        return useful / elapsed

    def run(self, reqs: list[tuple[list[int], int]], batch: int = 32) -> tuple[float, int]:
        """Static left-padded batches of ``batch``: (seconds, requested tokens made)."""
        useful, t0 = 0, time.perf_counter()
        for i in range(0, len(reqs), batch):
            chunk = reqs[i : i + batch]
            width = max(len(p) for p, _ in chunk)
            ids = torch.tensor([[2] * (width - len(p)) + p for p, _ in chunk], device=self.device)
            mask = torch.tensor(
                [[0] * (width - len(p)) + [1] * len(p) for p, _ in chunk], device=self.device
            )
            self._generate(ids, mask, max(n for _, n in chunk))
            useful += sum(n for _, n in chunk)
        self._sync()
        return time.perf_counter() - t0, useful


def measure(side: Any, args: argparse.Namespace, bar: tqdm[Any]) -> dict[str, float]:
    rng = random.Random(1)
    short = [rng.randrange(100, 40000) for _ in range(32)]
    work = mixed_workload(args.num_requests)
    side.decode(short, 8)  # warm-up
    bar.update(1)
    return {
        "decode_1_stream": _median(lambda: side.decode(short, 128), args.runs, bar),
        "prefill_512": _median(
            lambda: side.prefill([rng.randrange(100, 40000) for _ in range(512)]), args.runs, bar
        ),
        "mixed_64": _median(lambda: side.mixed(work), args.mixed_runs, bar),
    }


def write_chart(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = ["(a) decode, 1 stream", "(b) prefill, 512 tok", "(c) 64 mixed requests"]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    xs = range(len(FIGURES))
    ours = [report["ours"][f] for f in FIGURES]
    ax.bar([x - 0.2 for x in xs], ours, 0.4, label="native engine")
    if report.get("transformers"):
        hf = [report["transformers"][f] for f in FIGURES]
        ax.bar([x + 0.2 for x in xs], hf, 0.4, label="transformers generate()")
        for x, (a, b) in zip(xs, zip(ours, hf, strict=True), strict=True):
            ax.annotate(f"{a / b:.2f}x", (x - 0.2, a), ha="center", va="bottom")
    ax.set_xticks(list(xs), labels)
    ax.set_ylabel("tokens / s (median)")
    ax.set_yscale("log")
    ax.set_title(f"SmolLM2-135M, bf16 weights, {torch.get_num_threads()} CPU threads")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--mixed-runs", type=int, default=1)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument(
        "--threads", type=int, default=0, help="torch threads, both sides (0 = default)"
    )
    parser.add_argument(
        "--out", default="engine_bench", help="report file stem under bench/reports"
    )
    parser.add_argument("--model-dir", default=str(default_model_dir()))
    args = parser.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    model_dir = Path(args.model_dir)
    sides: list[tuple[str, Callable[[], Any]]] = [("ours", lambda: Ours(model_dir))]
    if not args.skip_hf:
        sides.append(("transformers", lambda: HF(model_dir)))
    report: dict[str, Any] = {
        "model": model_dir.name,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "runs": args.runs,
        "mixed_runs": args.mixed_runs,
        "num_requests": args.num_requests,
    }
    steps = len(sides) * (1 + 2 * args.runs + args.mixed_runs)
    with tqdm(total=steps, desc="engine bench", unit="run") as bar:
        for name, make in sides:
            bar.set_postfix_str(name)
            report[name] = measure(make(), args, bar)
    if "transformers" in report:
        report["ratio"] = {f: report["ours"][f] / report["transformers"][f] for f in FIGURES}
    print(f"\n{'figure':<18}{'ours tok/s':>12}{'transformers':>14}{'ratio':>8}")
    for f in FIGURES:
        hf = report.get("transformers", {}).get(f)
        ratio = f"{report['ratio'][f]:.2f}x" if hf else "-"
        print(f"{f:<18}{report['ours'][f]:>12.1f}{hf or 0:>14.1f}{ratio:>8}")
    save_report(args.out, report, lambda path: write_chart(report, path))


if __name__ == "__main__":
    main()
