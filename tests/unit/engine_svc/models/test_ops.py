"""The compiled CPU operators compute what their pure-torch versions compute."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_svc.models import cpu_kernels, ops
from engine_svc.models.attention import _gather
from engine_svc.models.linear import Linear

pytestmark = pytest.mark.skipif(
    not cpu_kernels.ops_available(), reason="no C++ compiler here: the CPU kernels are not built"
)
DTYPES = [torch.float32, torch.bfloat16]
KV_DTYPES = [torch.float32, torch.bfloat16, torch.float8_e4m3fn]
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_and_add_rms_norm(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 96, generator=g).to(dtype)
    res = torch.randn(7, 96, generator=g).to(dtype)
    w = torch.rand(96, generator=g).to(dtype)
    expected = (F.rms_norm(x.float(), (96,), None, 1e-5) * w.float()).to(dtype)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-5), expected, atol=TOL[dtype], rtol=0)
    res_ref = res.clone()
    out = ops.add_rms_norm(x, res, w, 1e-5)
    res_ref += x
    torch.testing.assert_close(res, res_ref)  # residual updated in place
    torch.testing.assert_close(out, ops.rms_norm(res_ref, w, 1e-5), atol=TOL[dtype], rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_torch_over_the_whole_range(dtype: torch.dtype) -> None:
    gate = torch.linspace(-120, 120, 4001)  # fast exp and the sigmoid must not overflow
    up = torch.linspace(-3, 3, 4001)
    x = torch.cat([gate, up]).view(1, -1).to(dtype)
    expected = (F.silu(x.float()[:, :4001]) * x.float()[:, 4001:]).to(dtype)
    got = ops.silu_and_mul(x)
    assert torch.isfinite(got.float()).all()
    torch.testing.assert_close(got.float(), expected.float(), atol=1e-3, rtol=TOL[dtype])


@settings(max_examples=25, deadline=None)
@given(
    num_tokens=st.integers(1, 9),
    heads=st.sampled_from([(4, 2), (6, 3), (9, 3), (8, 8)]),
    head_dim=st.sampled_from([8, 64, 128]),
    dtype=st.sampled_from(DTYPES),
    cache_dtype=st.sampled_from(KV_DTYPES),
    seed=st.integers(0, 1000),
)
def test_rotary_qkv_writes_the_same_cache_as_torch(
    num_tokens: int,
    heads: tuple[int, int],
    head_dim: int,
    dtype: torch.dtype,
    cache_dtype: torch.dtype,
    seed: int,
) -> None:
    nq, nkv = heads
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(num_tokens, (nq + 2 * nkv) * head_dim, generator=g).to(dtype)
    cos = torch.rand(64, head_dim // 2, generator=g)
    sin = torch.rand(64, head_dim // 2, generator=g)
    pos = torch.randint(0, 64, (num_tokens,), generator=g)
    slots = torch.randperm(32, generator=g)[:num_tokens]
    caches = [torch.zeros(8, 4, nkv, head_dim, dtype=cache_dtype) for _ in range(4)]
    scales = None
    if cache_dtype == torch.float8_e4m3fn:
        ks, vs = torch.rand(nkv, generator=g), torch.rand(nkv, generator=g)
        scales = (ks / 50 + 1e-3, vs / 50 + 1e-3)
    got = ops.rotary_qkv(qkv, cos, sin, pos, slots, caches[0], caches[1], nq, nkv, scales)
    cpu_kernels_on = cpu_kernels.ops_available
    try:
        cpu_kernels.ops_available = lambda: False  # type: ignore[assignment]
        ref = ops.rotary_qkv(qkv, cos, sin, pos, slots, caches[2], caches[3], nq, nkv, scales)
    finally:
        cpu_kernels.ops_available = cpu_kernels_on  # type: ignore[assignment]
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    # one rounding step of the cache format apart at most: fp32 math differs in the last bits
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float8_e4m3fn: 0.13}[cache_dtype]
    for a, b in ((caches[0], caches[2]), (caches[1], caches[3])):
        torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("native", [True, False])
def test_rotary_qkv_in_bf16_is_the_fp32_result_rounded_and_writes_the_same_cache(
    monkeypatch: pytest.MonkeyPatch, native: bool
) -> None:
    if native and not cpu_kernels.ops_available():
        pytest.skip("no C compiler here: the CPU kernels are not built")
    if not native:
        monkeypatch.setattr(cpu_kernels, "ops_available", lambda: False)
    nq, nkv, d, n = 9, 3, 64, 37
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(n, (nq + 2 * nkv) * d, generator=g).to(torch.bfloat16)
    cos, sin = torch.rand(64, d // 2, generator=g), torch.rand(64, d // 2, generator=g)
    pos = torch.randint(0, 64, (n,), generator=g)
    slots = torch.randperm(64, generator=g)[:n]
    caches = [torch.zeros(16, 4, nkv, d, dtype=torch.bfloat16) for _ in range(4)]
    wide = ops.rotary_qkv(qkv, cos, sin, pos, slots, caches[0], caches[1], nq, nkv)
    narrow = ops.rotary_qkv(
        qkv, cos, sin, pos, slots, caches[2], caches[3], nq, nkv, out_dtype=torch.bfloat16
    )
    assert wide.dtype == torch.float32
    assert narrow.dtype == torch.bfloat16
    assert torch.equal(narrow, wide.to(torch.bfloat16))
    assert torch.equal(caches[0], caches[2])
    assert torch.equal(caches[1], caches[3])


@settings(max_examples=40, deadline=None)
@given(
    context_lens=st.lists(st.integers(1, 70), min_size=1, max_size=6),
    heads=st.sampled_from([(4, 2), (9, 3), (8, 2), (8, 8)]),
    head_dim=st.sampled_from([16, 64, 128]),
    block_size=st.sampled_from([8, 16, 32]),
    cache_dtype=st.sampled_from(KV_DTYPES),
    out_dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 1000),
)
def test_decode_attention_matches_sdpa_over_gathered_blocks(
    context_lens: list[int],
    heads: tuple[int, int],
    head_dim: int,
    block_size: int,
    cache_dtype: torch.dtype,
    out_dtype: torch.dtype,
    seed: int,
) -> None:
    # (9, 3) and (8, 2) with head_dim 64 or 128 take the vectorized kernels; block
    # sizes below, at and above their 16-token chunk
    nq, nkv = heads
    bs, nb = block_size, 40
    context_lens = [min(c, 5 * bs) for c in context_lens]
    g = torch.Generator().manual_seed(seed)
    k_cache = (torch.randn(nb, bs, nkv, head_dim, generator=g) * 3).to(cache_dtype)
    v_cache = torch.randn(nb, bs, nkv, head_dim, generator=g).to(cache_dtype)
    scales = None
    if cache_dtype == torch.float8_e4m3fn:  # the stored values times a per-head scale
        scales = (torch.rand(nkv, generator=g) + 0.1, torch.rand(nkv, generator=g) + 0.1)
    b = len(context_lens)
    tables = torch.randperm(nb, generator=g)[: b * 5].view(b, 5).contiguous()
    ctx = torch.tensor(context_lens)
    q = torch.randn(b, nq, head_dim, generator=g)
    got = ops.paged_decode_attention(q, k_cache, v_cache, tables, ctx, out_dtype, scales)
    assert got.dtype == out_dtype
    k, v = _gather(k_cache, v_cache, tables, scales)
    mask = (torch.arange(5 * bs)[None, :] < ctx[:, None])[:, None, None, :]
    ref = F.scaled_dot_product_attention(
        q.view(b, nkv, nq // nkv, head_dim), k.float(), v.float(), attn_mask=mask
    ).reshape(b, nq * head_dim)
    # a bf16 cache on an AVX512-BF16 CPU takes q and P in bf16 (VDPBF16PS); elsewhere
    # the kernel widens it to fp32 and the output dtype's tolerance holds
    dot = cache_dtype == torch.bfloat16 and cpu_kernels.kernel_tier() in ("avx512_bf16", "amx")
    tol = TOL[torch.bfloat16] if dot else TOL[out_dtype]
    torch.testing.assert_close(got.float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("batch", [1, 8])
def test_decode_attention_reads_only_each_context_of_a_nan_filled_bf16_cache(batch: int) -> None:
    # odd context lengths leave a key pair half outside the context, and every slot
    # outside a context holds NaN: one NaN read would poison the row; batch 8 takes
    # the per-sequence kernel (with its spread prefetch), batch 1 the per-head one
    g = torch.Generator().manual_seed(batch)
    nq, nkv, d, bs, width = 9, 3, 64, 16, 6
    nb = batch * width + 2
    k_cache = torch.full((nb, bs, nkv, d), float("nan"), dtype=torch.bfloat16)
    v_cache = torch.full((nb, bs, nkv, d), float("nan"), dtype=torch.bfloat16)
    tables = torch.randperm(nb, generator=g)[: batch * width].view(batch, width).contiguous()
    ctx = torch.tensor([1 + 2 * ((7 * i + 3) % (width * bs // 2)) for i in range(batch)])
    for b in range(batch):
        for p in range(int(ctx[b])):
            blk, off = int(tables[b, p // bs]), p % bs
            k_cache[blk, off] = (torch.randn(nkv, d, generator=g) * 3).to(torch.bfloat16)
            v_cache[blk, off] = torch.randn(nkv, d, generator=g).to(torch.bfloat16)
    q = torch.randn(batch, nq, d, generator=g)
    got = ops.paged_decode_attention(q, k_cache, v_cache, tables, ctx, torch.float32, None)
    k, v = _gather(k_cache, v_cache, tables, None)
    mask = (torch.arange(width * bs)[None, :] < ctx[:, None])[:, None, None, :]
    k, v = k.float().nan_to_num(0.0), v.float().nan_to_num(0.0)
    ref = F.scaled_dot_product_attention(
        q.view(batch, nkv, nq // nkv, d), k, v, attn_mask=mask
    ).reshape(batch, nq * d)
    assert not got.isnan().any()
    torch.testing.assert_close(got, ref, atol=TOL[torch.bfloat16], rtol=TOL[torch.bfloat16])


def test_kernels_run_on_torch_threads_only() -> None:
    """The ops use torch's OpenMP pool: no thread outlives a call, none is added per call."""
    q = torch.randn(32, 9, 64)
    cache = torch.randn(64, 16, 3, 64)
    tables = torch.arange(64).view(32, 2).contiguous()
    ops.paged_decode_attention(q, cache, cache, tables, torch.full((32,), 30))
    before = threading.active_count()
    native_before = len(list(Path("/proc/self/task").iterdir()))
    for _ in range(20):
        ops.paged_decode_attention(q, cache, cache, tables, torch.full((32,), 30))
        ops.silu_and_mul(torch.randn(32, 256))
        torch.ops.llm_cpu.fp8_gemv(torch.randn(2, 64), torch.randint(0, 255, (96, 64)).byte())
    assert threading.active_count() == before
    assert len(list(Path("/proc/self/task").iterdir())) == native_before


@settings(max_examples=30, deadline=None)
@given(
    rows=st.integers(1, 5),
    vocab=st.integers(1, 300),
    ties=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_argmax_rows_is_torch_argmax_including_ties(
    rows: int, vocab: int, ties: bool, seed: int
) -> None:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g)
    if ties:  # a few distinct values: the first maximum must win, like torch
        logits = (logits * 2).round()
    logits[0, vocab // 2] = float("-inf")
    torch.testing.assert_close(ops.argmax_rows(logits), logits.argmax(dim=-1))


@pytest.mark.skipif(
    not bool(torch.ops.llm_cpu.amx_available()) if cpu_kernels.ops_available() else True,
    reason="this CPU has no AMX tiles (or the OS does not grant them)",
)
@settings(max_examples=30, deadline=None)
@given(
    rows=st.integers(1, 70),
    n_blocks=st.integers(1, 6),
    k_blocks=st.integers(1, 6),
    seed=st.integers(0, 1000),
)
def test_amx_linear_is_a_bf16_matmul_for_every_row_count(
    rows: int, n_blocks: int, k_blocks: int, seed: int
) -> None:
    """Partial 16-row tiles, one or two row tiles, several 32-row chunks; packed once."""
    g = torch.Generator().manual_seed(seed)
    n, k = 32 * n_blocks, 32 * k_blocks
    w = torch.randn(n, k, generator=g).bfloat16()
    x = torch.randn(rows, k, generator=g).bfloat16()
    lin = Linear(w)
    assert lin.can_pack("amx")
    lin.pack("amx")
    assert lin.packing == "amx"
    assert lin.packed is not None
    got = lin(x)
    ref = (x.float() @ w.float().T).bfloat16()  # fp32 accumulation, one final rounding
    assert got.dtype == torch.bfloat16
    assert got.shape == (rows, n)
    torch.testing.assert_close(got.float(), ref.float(), atol=1e-2 * k**0.5, rtol=1e-2)


def test_amx_packing_refuses_what_it_cannot_run() -> None:
    odd = Linear(torch.randn(48, 64).bfloat16())  # 48 output channels: not whole 32-blocks
    assert not odd.can_pack("amx")
    odd.pack("amx")
    assert odd.packed is None
    assert odd.packing == ""
    assert not Linear(torch.randn(64, 64)).can_pack("amx")  # fp32 weights
    with pytest.raises(RuntimeError, match="amx_pack"):
        torch.ops.llm_cpu.amx_pack(torch.randn(48, 64).bfloat16())
