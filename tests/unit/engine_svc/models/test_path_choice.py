"""The start-up dtype choice: a pure decision over injected step times, and the
measurement on a real (tiny) model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine_svc.models import path_choice
from engine_svc.models.path_choice import Workload, choose, workloads

# the shape of what was measured on an AVX512-BF16 CPU (issue figures, ms per step):
# fp32 wins a bare one-row GEMV, bf16 wins the batches the engine runs
AVX512_BF16 = {
    "float32": {"decode": 76.0, "prefill": 647.0, "single": 17.8},
    "bfloat16": {"decode": 44.5, "prefill": 399.0, "single": 8.4},
}
# and on an AVX2-only CPU, where a bf16 GEMM has no bf16 units
AVX2 = {
    "float32": {"decode": 251.0, "prefill": 600.0, "single": 51.0},
    "bfloat16": {"decode": 611.0, "prefill": 3100.0, "single": 31.0},
}


def test_the_batches_decide_not_one_row() -> None:
    assert choose(AVX512_BF16).name == "bfloat16"
    # bf16 wins the lone decode on the AVX2 CPU, yet loses the batches by far more
    assert choose(AVX2).name == "float32"
    assert choose({c: {"single": t["single"]} for c, t in AVX2.items()}).name == "bfloat16"


def test_scores_are_the_geometric_mean_of_the_step_times() -> None:
    result = choose({"a": {"x": 2.0, "y": 8.0}, "b": {"x": 3.0, "y": 6.0}})
    assert result.scores["a"] == pytest.approx(4.0)
    assert result.scores["b"] == pytest.approx(18.0**0.5)
    assert result.name == "a"


def test_a_tie_keeps_the_candidate_listed_first() -> None:
    same = {"x": 5.0, "y": 7.0}
    assert choose({"float32": same, "bfloat16": dict(same)}).name == "float32"
    assert choose({"bfloat16": dict(same), "float32": same}).name == "bfloat16"


def test_candidates_must_time_the_same_steps() -> None:
    with pytest.raises(ValueError, match="different step kinds"):
        choose({"a": {"x": 1.0}, "b": {"y": 1.0}})
    with pytest.raises(ValueError, match="no candidates"):
        choose({})


def test_reason_names_every_candidate_and_step() -> None:
    result = choose(AVX512_BF16)
    result.paths = {"bfloat16": "bfloat16+q4<=16+packed"}
    assert result.reason.startswith("bfloat16+q4<=16+packed [decode 44.5, prefill 399.0")
    assert " vs float32 [decode 76.0" in result.reason


def test_workloads_follow_the_scheduler_limits() -> None:
    steps = {w.name: w for w in workloads(max_num_seqs=24, prefill_chunk=384)}
    assert (steps["decode"].seqs, steps["decode"].new) == (24, 1)
    assert (steps["prefill"].seqs, steps["prefill"].new, steps["prefill"].context) == (1, 384, 0)
    assert (steps["single"].seqs, steps["single"].new) == (1, 1)


def test_measure_times_every_candidate_on_every_step(tiny_model_dir: Path) -> None:
    steps = [Workload("decode", 4, 1, 20), Workload("prefill", 1, 24, 0)]
    result = path_choice.measure(
        tiny_model_dir,
        (torch.float32, torch.bfloat16),
        steps,
        lambda dt: dt,
        block_size=4,
        layers=1,
    )
    assert set(result.timings_ms) == {"float32", "bfloat16"}
    for times in result.timings_ms.values():
        assert set(times) == {"decode", "prefill"}
        assert all(ms > 0 for ms in times.values())
    assert result.name == min(result.scores, key=lambda c: result.scores[c])
    assert result.paths["float32"].startswith("float32")
