"""FP8 weights and FP8 KV cache: storage, exactness of the kernels, capacity, agreement."""

from __future__ import annotations

import pytest
import torch

from engine_svc.core import EngineConfig, SamplingParams
from engine_svc.core.model_runner import determine_num_blocks
from engine_svc.models import fp8, kv_fp8
from engine_svc.models.config import load_model_config

from ..conftest import EngineFactory
from ..helpers import run_to_completion, tokens_of


def test_fp8_weight_is_per_channel_and_quarter_size() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 64, generator=g) * torch.logspace(-3, 1, 48)[:, None]
    q = fp8.Fp8Weight(w)
    assert q.qweight.dtype == torch.float8_e4m3fn
    assert q.scale.shape == (48,)
    assert q.nbytes == 48 * 64 + 48 * 4
    rel = (q.dequantize() - w).abs() / w.abs().amax(dim=1, keepdim=True)
    assert float(rel.max()) <= 2**-4  # e4m3: 3 mantissa bits, per-row range


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 40])
def test_fp8_linear_matches_dequantized_reference(rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    w = fp8.Fp8Weight(torch.randn(40, 72, generator=g))
    x = torch.randn(rows, 72, generator=g)
    ref = x @ w.dequantize().t()
    out = fp8.fp8_linear(x, w)
    assert out.shape == (rows, 40)
    assert out.dtype == torch.float32
    tol = 1e-4 if rows <= fp8.GEMV_MAX_ROWS else 5e-2  # GEMV is fp32; large batches run bf16
    assert torch.allclose(out, ref, atol=tol * float(ref.abs().max()), rtol=0)


def test_fp8_kv_write_and_gather_round_trip() -> None:
    g = torch.Generator().manual_seed(1)
    cache = torch.zeros(4, 2, 3, 8, dtype=torch.float8_e4m3fn)  # 4 blocks of 2 slots
    x = torch.randn(5, 3, 8, generator=g) * torch.tensor([0.1, 1.0, 10.0])[None, :, None]
    scale = kv_fp8.scales_from_amax(x.abs().amax(dim=(0, 2)))
    kv_fp8.write_kv(cache, torch.tensor([2, 3, 4, 6, 7]), x, scale)
    ctx = kv_fp8.gather_kv(cache, torch.tensor([[1, 2, 3]]), scale)  # slots 2..7
    got = ctx[0].transpose(0, 1)[[0, 1, 2, 4, 5]]
    assert torch.allclose(got, x, rtol=2**-3, atol=float(scale.max()) * 2**-9)
    assert float(ctx[0].transpose(0, 1)[3].abs().max()) == 0.0  # untouched slot 5


def test_fp8_kv_pool_holds_four_times_fp32(make_tiny_engine: EngineFactory) -> None:
    engine = make_tiny_engine()
    mc = load_model_config(engine.model_dir)
    budget = 1 << 20
    cfg = EngineConfig(kv_cache_memory_bytes=budget, block_size=4)
    n32 = determine_num_blocks(cfg, mc, torch.float32, torch.device("cpu"))
    n16 = determine_num_blocks(cfg, mc, torch.bfloat16, torch.device("cpu"))
    n8 = determine_num_blocks(cfg, mc, torch.float8_e4m3fn, torch.device("cpu"))
    assert (n16, n8) == (2 * n32, 4 * n32)
    fp8_engine = make_tiny_engine(
        kv_cache_dtype="fp8", num_kv_blocks=0, kv_cache_memory_bytes=budget
    )
    assert fp8_engine.runner.num_blocks == n8
    assert fp8_engine.runner.kv_cache_bytes <= budget
    assert fp8_engine.model_info().kv_cache_dtype == "float8_e4m3fn"


@pytest.mark.parametrize(
    "cfg", [{"kv_cache_dtype": "fp8"}, {"quantization": "fp8"}], ids=["fp8-kv", "fp8-weights"]
)
def test_fp8_engine_runs_batched_and_frees(
    make_tiny_engine: EngineFactory, cfg: dict[str, str]
) -> None:
    """Mechanics on the tiny model; output quality is checked on the real model (quality test)."""
    engine = make_tiny_engine(**cfg)
    prompts = [[5, 17, 33, 2, 9, 11, 40, 41, 42], [60, 61, 62, 63, 64, 65, 66]]
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_tokens=6, ignore_eos=True, logprobs=1))
    res = run_to_completion(engine)
    for i in range(len(prompts)):
        toks = tokens_of(res[str(i)])
        lps = [lp.logprob for o in res[str(i)] for lp in (o.new_logprobs or [])]
        assert len(toks) == 6
        assert all(-1e4 < lp <= 0 for lp in lps)
    assert engine.kv_cache_manager.block_pool.num_used_blocks == 0


def test_unknown_modes_are_rejected(make_tiny_engine: EngineFactory) -> None:
    with pytest.raises(ValueError, match="quantization"):
        make_tiny_engine(quantization="int4")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        make_tiny_engine(kv_cache_dtype="int8")
