"""The fused prefill attention (AMX or AVX512-BF16 in bf16; AVX2 in fp32): causal chunks
over paged contexts, against dense fp32."""

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


# the bf16 kernel (AMX or AVX512-BF16) is the one the engine takes where it is built;
# the fp32 one (AVX2) runs on any CPU with AVX2 when q is fp32, so both are tested here
# wherever they are built
BF16 = pytest.mark.skipif(
    ops.prefill_kernel_dtype() != torch.bfloat16,
    reason="the bf16 prefill kernel needs a CPU with AVX512-BF16 (or AMX) and a compiler",
)
F32 = pytest.mark.skipif(
    not (cpu_kernels.ops_available() and torch.ops.llm_cpu.prefill_attention_f32_available()),
    reason="the fp32 prefill kernel needs a CPU with AVX2 and a compiler",
)


def _layout(
    computed: list[int], lens: list[int], bs: int, hkv: int, d: int, g: torch.Generator,
    dtype: torch.dtype = torch.bfloat16,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[list[int]]]:  # fmt: skip
    """A cache whose unused slots hold NaN, each context in shuffled blocks."""
    nblk = [-(-(c + n) // bs) for c, n in zip(computed, lens, strict=True)]
    num_blocks = sum(nblk) + 3
    k_cache = torch.full((num_blocks, bs, hkv, d), float("nan"), dtype=dtype)
    v_cache = torch.full((num_blocks, bs, hkv, d), float("nan"), dtype=dtype)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, used = [], 0
    for b in nblk:
        tables.append(perm[used : used + b])
        used += b
    width = max(nblk)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
    return k_cache, v_cache, padded, tables


def _run(
    computed: list[int], lens: list[int], h: int, hkv: int, d: int, bs: int, seed: int,
    q_dtype: torch.dtype = torch.bfloat16, cache_dtype: torch.dtype = torch.bfloat16,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The kernel's output and the dense fp32 reference for one step's chunks (fp32 q
    goes to the op itself: the fp32 kernel, whichever the engine would take here)."""
    g = torch.Generator().manual_seed(seed)
    k_cache, v_cache, tables, table_lists = _layout(computed, lens, bs, hkv, d, g, cache_dtype)
    ctx = [c + n for c, n in zip(computed, lens, strict=True)]
    ks = [torch.randn(n, hkv, d, generator=g).to(cache_dtype) for n in ctx]
    vs = [torch.randn(n, hkv, d, generator=g).to(cache_dtype) for n in ctx]
    for k, v, t in zip(ks, vs, table_lists, strict=True):
        slots = torch.tensor([t[p // bs] * bs + p % bs for p in range(k.shape[0])])
        k_cache.view(-1, hkv, d).index_copy_(0, slots, k)
        v_cache.view(-1, hkv, d).index_copy_(0, slots, v)
    total = sum(lens)
    # q as the model hands it over: a strided view into the fused qkv rows
    qkv = torch.randn(total, h + 2 * hkv, d, generator=g).to(q_dtype)
    q = qkv[:, :h]
    rows, seqs = 0, []
    for c, n in zip(computed, lens, strict=True):
        seqs.append([rows, n, c])
        rows += n
    if q_dtype == torch.float32:
        out = torch.ops.llm_cpu.prefill_attention(
            q, k_cache, v_cache, torch.tensor(seqs), tables, d**-0.5
        )
    else:
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


@BF16
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


@BF16
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    segs=st.lists(st.tuples(st.integers(0, 200), st.integers(1, 96)), min_size=1, max_size=4),
    bs=st.sampled_from([16, 32]),
    seed=st.integers(0, 2**16),
)
def test_any_step_of_chunks_matches_dense(segs: list[tuple[int, int]], bs: int, seed: int) -> None:
    out, ref = _run([c for c, _ in segs], [n for _, n in segs], 6, 2, 64, bs, seed)
    _assert_close(out, ref)


@BF16
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


@BF16
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


@BF16
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


@BF16
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


@BF16
def test_choice_times_both_where_the_kernel_runs_and_skips_fp32_caches() -> None:
    fused, ms = choose_prefill_kernel(6, 2, 64, torch.bfloat16, torch.bfloat16, 16)
    assert set(ms) == {"fused", "sdpa"}
    assert all(t > 0 for t in ms.values())
    assert fused == (ms["fused"] < ms["sdpa"])
    assert choose_prefill_kernel(6, 2, 64, torch.float32, torch.float32, 16) == (False, {})


def _assert_close_f32(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.dtype == torch.float32
    assert torch.isfinite(out).all(), "NaN from unused cache slots leaked into the output"
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)  # fp32 math throughout


@F32
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    ("computed", "lens"),
    [
        ([0], [1]),
        ([0], [7]),
        ([0], [300]),
        ([37], [50]),
        ([1000], [24]),
        ([0, 300, 5], [70, 33, 1]),
    ],
)
@pytest.mark.parametrize(("h", "hkv", "d"), [(9, 3, 64), (4, 4, 128)])
def test_fp32_kernel_chunks_match_dense_causal_attention(
    computed: list[int], lens: list[int], h: int, hkv: int, d: int, cache_dtype: torch.dtype
) -> None:
    out, ref = _run(computed, lens, h, hkv, d, 16, sum(lens) + h, torch.float32, cache_dtype)
    _assert_close_f32(out, ref)


@F32
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    segs=st.lists(st.tuples(st.integers(0, 200), st.integers(1, 96)), min_size=1, max_size=4),
    bs=st.sampled_from([16, 32]),
    cache_dtype=st.sampled_from([torch.bfloat16, torch.float32]),
    seed=st.integers(0, 2**16),
)
def test_fp32_kernel_matches_dense_for_any_step(
    segs: list[tuple[int, int]], bs: int, cache_dtype: torch.dtype, seed: int
) -> None:
    lens = [n for _, n in segs]
    out, ref = _run([c for c, _ in segs], lens, 6, 2, 64, bs, seed, torch.float32, cache_dtype)
    _assert_close_f32(out, ref)


@F32
def test_fp32_kernel_refuses_what_it_cannot_read() -> None:
    seqs, tables = torch.tensor([[0, 4, 0]]), torch.tensor([[0]])
    q = torch.zeros(4, 4, 64)
    fp8 = torch.zeros(2, 16, 2, 64).to(torch.float8_e4m3fn)
    with pytest.raises(RuntimeError, match="caches must be bfloat16"):
        torch.ops.llm_cpu.prefill_attention(q, fp8, fp8, seqs, tables, 0.125)
    with pytest.raises(RuntimeError, match="q must be bfloat16 or float32"):
        torch.ops.llm_cpu.prefill_attention(q.double(), fp8, fp8, seqs, tables, 0.125)


@pytest.mark.skipif(
    ops.prefill_kernel_dtype() != torch.float32,
    reason="the engine takes the fp32 kernel only where the bf16 one is not built (AVX2)",
)
def test_where_fp32_is_the_kernel_the_engine_path_takes_it_and_times_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On an AVX2 CPU (or one capped to it): paged_attention's prefill rows come from the
    fp32 kernel and match the SDPA path's; the start-up choice times both."""
    kernel_calls = []
    real = ops.prefill_attention

    def counted(*args: torch.Tensor) -> torch.Tensor:  # the real kernel, its calls counted
        kernel_calls.append(args[0].dtype)
        return real(*args)

    monkeypatch.setattr(ops, "prefill_attention", counted)
    g = torch.Generator().manual_seed(5)
    h, hkv, d, bs = 6, 2, 64, 16
    computed, new = [0, 40], [33, 20]
    # an fp32 cache: the SDPA path attends a fresh chunk's own K/V, which a bf16 cache
    # would hold rounded (the kernel reads the cache)
    k_cache = torch.zeros(16, bs, hkv, d)
    v_cache = torch.zeros(16, bs, hkv, d)
    tables = [[3, 4, 5], [7, 8, 9, 10]]
    meta, _ = build_attention_metadata([0], [40], [tables[1]], 0, bs, CPU)
    kv = torch.randn(40, hkv, d, generator=g)
    paged_attention(torch.zeros(40, h, d), kv, kv, k_cache, v_cache, meta)
    q = torch.randn(sum(new), h, d, generator=g)
    k = torch.randn(sum(new), hkv, d, generator=g)
    v = torch.randn(sum(new), hkv, d, generator=g)
    outs = []
    for fused in (False, True):
        meta, _ = build_attention_metadata(computed, new, tables, 0, bs, CPU)
        meta.prefill_kernel = fused
        outs.append(paged_attention(q, k, v, k_cache.clone(), v_cache.clone(), meta))
    assert kernel_calls == [torch.float32]  # the fused run took the kernel, the other not
    assert outs[1].dtype == torch.float32
    torch.testing.assert_close(outs[1], outs[0], atol=1e-4, rtol=1e-4)
    fused_wins, ms = choose_prefill_kernel(h, hkv, d, torch.float32, torch.bfloat16, bs)
    assert set(ms) == {"fused", "sdpa"}
    assert fused_wins == (ms["fused"] < ms["sdpa"])


@F32
def test_fp32_kernel_takes_a_step_of_long_contexts_in_groups() -> None:
    # 3 chunks over 8k-token contexts: 96 MB of widened K^T and V at 128 dims x 4 KV heads,
    # more than the kernel holds at once (64 MB), so it runs them as two groups
    out, ref = _run([8190, 8190, 8000], [2, 2, 40], 4, 4, 128, 16, 9, torch.float32)
    _assert_close_f32(out, ref)


@BF16
def test_bf16_kernel_takes_a_step_of_long_contexts_in_groups() -> None:
    # 4 chunks over ~16k-token contexts: 128 MB of V^T tiles at 128 dims x 8 KV heads,
    # more than the kernel holds at once (64 MB), so it runs them as groups
    lens = [2, 2, 2, 40]
    out, ref = _run([16380, 16380, 16000, 16300], lens, 8, 8, 128, 64, 3)
    _assert_close(out, ref)
