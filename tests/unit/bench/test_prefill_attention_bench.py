"""bench.prefill_attention_bench measures both sides on the same rows."""

from __future__ import annotations

import pytest
import torch

from bench import prefill_attention_bench as pab
from engine_svc.models import cpu_kernels, ops


def _kernel_here() -> bool:
    q = torch.empty(1, pab.HEADS, pab.HEAD_DIM, dtype=torch.bfloat16)
    cache = torch.empty(1, pab.BLOCK, pab.KV_HEADS, pab.HEAD_DIM, dtype=torch.bfloat16)
    return cpu_kernels.ops_available() and ops.prefill_kernel_usable(q, cache, None)


@pytest.mark.skipif(
    not _kernel_here(), reason="the fused prefill kernel needs AVX2 (fp32) or AVX512-BF16"
)
def test_a_case_times_both_sides_and_they_agree() -> None:
    row = pab._case([0, 40], [24, 20], rounds=1)
    assert row["fused_ms"] > 0
    assert row["sdpa_ms"] > 0
    assert row["ratio"] == pytest.approx(row["sdpa_ms"] / row["fused_ms"])
    assert row["max_abs_diff"] < 0.05  # the same attention (bf16 outputs where the kernel is bf16)
