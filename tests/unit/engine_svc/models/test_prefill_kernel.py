"""The fused prefill attention (AMX or AVX512-BF16): causal chunks over paged contexts,
against dense fp32."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_svc.models import cpu_kernels, ops
from engine_svc.models.attention import (
    build_attention_metadata,
    choose_prefill_kernel,
    paged_attention,
)

CPU = torch.device("cpu")


def _kernel_here() -> bool:
    probe_q = torch.empty(1, 4, 64, dtype=torch.bfloat16)
    probe_cache = torch.empty(1, 16, 4, 64, dtype=torch.bfloat16)
    return cpu_kernels.ops_available() and ops.prefill_kernel_usable(probe_q, probe_cache, None)


pytestmark = pytest.mark.skipif(
    not _kernel_here(),
    reason="the fused prefill kernel needs a CPU with AVX512-BF16 (or AMX) and a compiler",
)


def _layout(
    computed: list[int], lens: list[int], bs: int, hkv: int, d: int, g: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[list[int]]]:
    """A bf16 cache whose unused slots hold NaN, each context in shuffled blocks."""
    nblk = [-(-(c + n) // bs) for c, n in zip(computed, lens, strict=True)]
    num_blocks = sum(nblk) + 3
    k_cache = torch.full((num_blocks, bs, hkv, d), float("nan"), dtype=torch.bfloat16)
    v_cache = torch.full((num_blocks, bs, hkv, d), float("nan"), dtype=torch.bfloat16)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, used = [], 0
    for b in nblk:
        tables.append(perm[used : used + b])
        used += b
    width = max(nblk)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
    return k_cache, v_cache, padded, tables


def _run(
    computed: list[int], lens: list[int], h: int, hkv: int, d: int, bs: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's output and the dense fp32 reference for one step's chunks."""
    g = torch.Generator().manual_seed(seed)
    k_cache, v_cache, tables, table_lists = _layout(computed, lens, bs, hkv, d, g)
    ctx = [c + n for c, n in zip(computed, lens, strict=True)]
    ks = [torch.randn(n, hkv, d, generator=g).to(torch.bfloat16) for n in ctx]
    vs = [torch.randn(n, hkv, d, generator=g).to(torch.bfloat16) for n in ctx]
    for k, v, t in zip(ks, vs, table_lists, strict=True):
        slots = torch.tensor([t[p // bs] * bs + p % bs for p in range(k.shape[0])])
        k_cache.view(-1, hkv, d).index_copy_(0, slots, k)
        v_cache.view(-1, hkv, d).index_copy_(0, slots, v)
    total = sum(lens)
    # q as the model hands it over: a strided view into the fused qkv rows
    qkv = torch.randn(total, h + 2 * hkv, d, generator=g).to(torch.bfloat16)
    q = qkv[:, :h]
    rows, seqs = 0, []
    for c, n in zip(computed, lens, strict=True):
        seqs.append([rows, n, c])
        rows += n
    out = ops.prefill_attention(q, k_cache, v_cache, torch.tensor(seqs), tables)
    ref = torch.zeros(total, h * d)
    for (row, n, c), k, v in zip(seqs, ks, vs, strict=True):
        if n == 0:
            continue
        mask = torch.arange(c + n)[None, :] <= torch.arange(c, c + n)[:, None]
        o = F.scaled_dot_product_attention(
            q[row : row + n].float().transpose(0, 1)[None],
            k.float().transpose(0, 1)[None],
            v.float().transpose(0, 1)[None],
            attn_mask=mask,
            enable_gqa=True,
        )
        ref[row : row + n] = o[0].transpose(0, 1).reshape(n, h * d)
    return out, ref


def _assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.dtype == torch.bfloat16
    assert torch.isfinite(out).all(), "NaN from unused cache slots leaked into the output"
    # P and the output are rounded to bf16 (8 significant bits)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    assert float((out.float() - ref).abs().mean()) < 3e-3


@pytest.mark.parametrize(
    ("computed", "lens"),
    [
        ([0], [1]),
        ([0], [16]),
        ([0], [17]),
        ([0], [300]),
        ([64], [64]),
        ([37], [50]),
        ([1000], [24]),
        ([0, 300, 17, 5], [128, 33, 1, 70]),
    ],
)
@pytest.mark.parametrize(("h", "hkv", "d"), [(9, 3, 64), (4, 4, 128), (8, 2, 64)])
def test_chunks_match_dense_causal_attention(
    computed: list[int], lens: list[int], h: int, hkv: int, d: int
) -> None:
    out, ref = _run(computed, lens, h, hkv, d, bs=16, seed=sum(lens) + h)
    _assert_close(out, ref)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    segs=st.lists(st.tuples(st.integers(0, 200), st.integers(1, 96)), min_size=1, max_size=4),
    bs=st.sampled_from([16, 32]),
    seed=st.integers(0, 2**16),
)
def test_any_step_of_chunks_matches_dense(segs: list[tuple[int, int]], bs: int, seed: int) -> None:
    out, ref = _run([c for c, _ in segs], [n for _, n in segs], 6, 2, 64, bs, seed)
    _assert_close(out, ref)


def test_rows_of_no_sequence_are_zero_and_empty_chunks_are_skipped() -> None:
    g = torch.Generator().manual_seed(1)
    k_cache = torch.randn(4, 16, 2, 64, generator=g).to(torch.bfloat16)
    v_cache = torch.randn(4, 16, 2, 64, generator=g).to(torch.bfloat16)
    q = torch.randn(10, 4, 64, generator=g).to(torch.bfloat16)
    seqs = torch.tensor([[2, 5, 0], [7, 0, 3]])
    out = ops.prefill_attention(q, k_cache, v_cache, seqs, torch.tensor([[0], [1]]))
    assert out.shape == (10, 4 * 64)
    assert (out[:2] == 0).all()
    assert (out[7:] == 0).all()
    assert (out[2:7] != 0).any()


@pytest.mark.parametrize(
    ("seqs", "tables", "message"),
    [
        ([[0, 4, 0]], [[9]], "block 0 is 9, the cache has 4"),
        ([[0, 4, 30]], [[0]], "needs 3 blocks, its table holds 1"),
        ([[6, 8, 0]], [[0]], "fall outside q's 10 rows"),
    ],
)
def test_refuses_tables_and_rows_that_do_not_fit(
    seqs: list[list[int]], tables: list[list[int]], message: str
) -> None:
    k_cache = torch.zeros(4, 16, 2, 64, dtype=torch.bfloat16)
    q = torch.zeros(10, 4, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=message):
        ops.prefill_attention(q, k_cache, k_cache, torch.tensor(seqs), torch.tensor(tables))


def test_usable_only_for_caches_it_can_read() -> None:
    q = torch.empty(1, 4, 64, dtype=torch.bfloat16)
    bf16 = torch.empty(1, 16, 2, 64, dtype=torch.bfloat16)
    scales = (torch.ones(2), torch.ones(2))
    assert ops.prefill_kernel_usable(q, bf16, None)
    assert not ops.prefill_kernel_usable(q, bf16.float(), None)  # fp32 cache
    assert not ops.prefill_kernel_usable(q, bf16, scales)  # an FP8 cache's scales
    assert not ops.prefill_kernel_usable(q, torch.empty(1, 8, 2, 64, dtype=torch.bfloat16), None)
    assert not ops.prefill_kernel_usable(q, torch.empty(1, 16, 2, 32, dtype=torch.bfloat16), None)
    assert not ops.prefill_kernel_usable(torch.empty(1, 3, 64), bf16, None)  # 3 heads over 2


def test_paged_attention_takes_the_kernel_for_a_mixed_step() -> None:
    """Decodes then prefills in one step: with the kernel on, the prefill rows match
    the SDPA path's and the decode rows are the same rows either way."""
    g = torch.Generator().manual_seed(3)
    h, hkv, d, bs = 6, 2, 64, 16
    computed, new, num_decodes = [40, 0, 70], [1, 33, 20], 1
    k_cache = torch.zeros(32, bs, hkv, d, dtype=torch.bfloat16)
    v_cache = torch.zeros(32, bs, hkv, d, dtype=torch.bfloat16)
    tables = [[3, 4, 5, 6], [7, 8, 9], [10, 11, 12, 13, 14, 15]]
    for c, t in zip(computed, tables, strict=True):  # the cached prefixes
        if c:
            meta, _ = build_attention_metadata([0], [c], [t], 0, bs, CPU)
            kv = torch.randn(c, hkv, d, generator=g).to(torch.bfloat16)
            paged_attention(
                torch.zeros(c, h, d, dtype=torch.bfloat16), kv, kv, k_cache, v_cache, meta
            )
    total = sum(new)
    q = torch.randn(total, h, d, generator=g).to(torch.bfloat16)
    k = torch.randn(total, hkv, d, generator=g).to(torch.bfloat16)
    v = torch.randn(total, hkv, d, generator=g).to(torch.bfloat16)
    outs = []
    for fused in (False, True):
        meta, _ = build_attention_metadata(computed, new, tables, num_decodes, bs, CPU)
        meta.prefill_kernel = fused
        outs.append(
            paged_attention(
                q, k, v, k_cache.clone(), v_cache.clone(), meta, out_dtype=torch.float32
            )
        )
    torch.testing.assert_close(outs[1], outs[0], atol=2e-2, rtol=2e-2)
    assert torch.equal(outs[1][:num_decodes], outs[0][:num_decodes])


def test_choice_times_both_where_the_kernel_runs_and_skips_fp32_caches() -> None:
    fused, ms = choose_prefill_kernel(6, 2, 64, torch.bfloat16, torch.bfloat16, 16)
    assert set(ms) == {"fused", "sdpa"}
    assert all(t > 0 for t in ms.values())
    assert fused == (ms["fused"] < ms["sdpa"])
    assert choose_prefill_kernel(6, 2, 64, torch.float32, torch.float32, 16) == (False, {})
