"""On every tier this machine can cap to, the path the engine selects there keeps the
fp32 reference's greedy output.

Each tier runs in a process of its own (a process loads one kernel build, and torch
reads ATEN_CPU_CAPABILITY / ONEDNN_MAX_CPU_ISA once), with the engine's defaults
(dtype ``auto``: the start-up measurement picks the path) and the cap set through the
environment as a deployment would set it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM

from common.config import ROOT
from engine_svc.models import cpu_tier

# a tier's first run compiles its kernels (about 30 s on a quiet machine, cached after)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

PROMPT = "The capital of France is"
NEW_TOKENS = 8
# bf16 weights and KV move this model's logits by ~0.13 on average against fp32: where the
# reference's top-1/top-2 margin is below this, either token is a correct greedy choice
NOISE_MARGIN = 0.5
TORCH_SWITCHES = {"avx512_bf16": ("avx512", "AVX512_CORE_BF16"), "avx2": ("avx2", "AVX2")}
WORKER = """
import json, sys
import torch
from engine_svc.core import EngineConfig, LLMEngine, SamplingParams
from engine_svc.core.config import SchedulerConfig
from engine_svc.models import cpu_kernels
# a small batch keeps the start-up measurement short; the engine still picks the path
sched = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=128)
config = EngineConfig(model_dir=sys.argv[1], num_kv_blocks=32, cpu_isa=sys.argv[4], scheduler=sched)
engine = LLMEngine(config)
params = SamplingParams(max_tokens=int(sys.argv[3]), ignore_eos=True)
engine.add_request("r", json.loads(sys.argv[2]), params)
tokens = []
while engine.has_unfinished_requests():
    for out in engine.step():
        tokens += out.new_token_ids
print(json.dumps({"tokens": tokens, "compute": engine.compute_description,
                  "kernels": cpu_kernels.kernel_tier(),
                  "aten": str(torch.backends.cpu.get_cpu_capability())}))
"""


def _reachable_tiers() -> list[str]:
    native = cpu_tier.native_tier()
    return [t for t in TORCH_SWITCHES if cpu_tier.TIERS.index(t) <= cpu_tier.TIERS.index(native)]


def _cap_env(tier: str) -> dict[str, str]:
    """The environment of a process capped to ``tier``: our kernels, ATen and oneDNN alike."""
    aten, onednn = TORCH_SWITCHES[tier]
    return os.environ | {
        cpu_tier.CAP_ENV: tier,
        "ATEN_CPU_CAPABILITY": aten,
        "ONEDNN_MAX_CPU_ISA": onednn,
        "PYTHONPATH": str(ROOT),
    }


@pytest.fixture(scope="module")
def prompt(model_dir: Path) -> list[int]:
    return Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(PROMPT).ids


@pytest.fixture(scope="module")
def reference(model_dir: Path, prompt: list[int]) -> tuple[list[int], list[float]]:
    """HF fp32 greedy tokens and the top-1/top-2 margin at each step."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokens, margins = [], []
    with torch.inference_mode():
        ids = list(prompt)
        for _ in range(NEW_TOKENS):
            logits = model(torch.tensor([ids])).logits[0, -1]
            top2 = logits.topk(2).values
            tokens.append(int(logits.argmax()))
            margins.append(float(top2[0] - top2[1]))
            ids.append(tokens[-1])
    return tokens, margins


@pytest.mark.parametrize("tier", list(TORCH_SWITCHES))
def test_selected_path_keeps_fp32_greedy_on_each_tier(
    tier: str, model_dir: Path, prompt: list[int], reference: tuple[list[int], list[float]]
) -> None:
    if tier not in _reachable_tiers():
        pytest.skip(f"this CPU ({cpu_tier.native_tier()}) cannot run tier {tier}")
    proc = subprocess.run(
        [sys.executable, "-c", WORKER, str(model_dir), json.dumps(prompt), str(NEW_TOKENS), tier],
        env=_cap_env(tier),
        capture_output=True,
        text=True,
        timeout=850,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    if os.environ.get("LLM_ENGINE_CPU_KERNELS", "1") != "0":
        assert got["kernels"] == tier, got
    assert got["aten"] == TORCH_SWITCHES[tier][0].upper(), got
    assert f"isa={tier}" in got["compute"] or not got["kernels"], got
    tokens, margins = reference
    for i, (a, b) in enumerate(zip(got["tokens"], tokens, strict=True)):
        if a != b:
            assert margins[i] < NOISE_MARGIN, (
                f"tier {tier} diverged at {i} with margin {margins[i]:.3f} ({got['compute']})"
            )
            break


@pytest.mark.parametrize("tier", list(TORCH_SWITCHES))
def test_the_kernel_tests_pass_in_each_lower_tier_build(tier: str) -> None:
    """The operator tests (test_ops.py: decode attention against SDPA with hypothesis, the
    NaN-filled cache, norms, rotary, argmax; test_prefill_kernel.py: the fused prefill
    kernel the tier has, and the engine's path through it; test_q4.py: the 4-bit GEMM
    for the tier's dtype) against the kernels built for a lower tier: each tier compiles
    other ``#if`` branches (AVX2 has its own decode and prefill attention and runs the
    4-bit weights on fp32 rows), and this session's own run covers only this CPU's."""
    if tier not in _reachable_tiers():
        pytest.skip(f"this CPU ({cpu_tier.native_tier()}) cannot run tier {tier}")
    if tier == cpu_tier.native_tier():
        pytest.skip("this CPU's own tier: the session runs test_ops.py itself")
    files = [
        str(Path(__file__).with_name(f))
        for f in ("test_ops.py", "test_prefill_kernel.py", "test_q4.py")
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", *files, "-q", "-p", "no:cacheprovider"],
        env=_cap_env(tier),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=850,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    passed = re.search(r"(\d+) passed", proc.stdout)
    assert passed is not None, proc.stdout[-2000:]
    assert int(passed.group(1)) >= 8, proc.stdout[-2000:]
