"""Paged attention: the C decode kernel and the SDPA path agree with dense attention."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine_svc.models import cpu_kernels
from engine_svc.models.attention import build_attention_metadata, paged_attention

H, HKV, D, BS, NB = 6, 2, 16, 4, 64
CPU = torch.device("cpu")


def dense_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """Causal attention of q (positions start..) over the full k/v [L, Hkv, D]."""
    n, length = q.shape[0], k.shape[0]
    mask = torch.arange(length)[None, :] <= (start + torch.arange(n))[:, None]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        attn_mask=mask,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1).reshape(n, H * D)


@pytest.mark.parametrize(
    ("use_kernel", "prefill_dtype"),
    [(True, None), (False, None), (True, torch.bfloat16)],
)
def test_mixed_batch_matches_dense(
    monkeypatch: pytest.MonkeyPatch, use_kernel: bool, prefill_dtype: torch.dtype | None
) -> None:
    if use_kernel and not cpu_kernels.ops_available():
        pytest.skip("no C compiler here: the CPU decode kernel is not built")
    if not use_kernel:
        monkeypatch.setattr(cpu_kernels, "ops_available", lambda: False)
    g = torch.Generator().manual_seed(0)
    # run order 1, 2, 0, 3, 4: decodes with contexts 9 and 23, then prefills of
    # 1 fresh token, 4 new on 5 cached, and 7 fresh
    computed, new, num_decodes = [0, 8, 22, 5, 0], [1, 1, 1, 4, 7], 2
    lens = [c + n for c, n in zip(computed, new, strict=True)]
    perm = torch.randperm(NB, generator=g).tolist()
    tables, used = [], 0
    for length in lens:
        nblk = -(-length // BS)
        tables.append(perm[used : used + nblk])
        used += nblk
    k_cache, v_cache = torch.zeros(NB, BS, HKV, D), torch.zeros(NB, BS, HKV, D)
    full = [
        (torch.randn(n, HKV, D, generator=g), torch.randn(n, HKV, D, generator=g)) for n in lens
    ]
    for (k, v), c, t in zip(full, computed, tables, strict=True):  # prefill the cached prefixes
        if c:
            meta, _ = build_attention_metadata([0], [c], [t], 0, BS, CPU)
            paged_attention(torch.zeros(c, H, D), k[:c], v[:c], k_cache, v_cache, meta)
    order = [1, 2, 0, 3, 4]
    qs = {i: torch.randn(new[i], H, D, generator=g) for i in order}
    meta, _ = build_attention_metadata(
        [computed[i] for i in order],
        [new[i] for i in order],
        [tables[i] for i in order],
        num_decodes,
        BS,
        CPU,
    )
    q = torch.cat([qs[i] for i in order])
    k = torch.cat([full[i][0][computed[i] :] for i in order])
    v = torch.cat([full[i][1][computed[i] :] for i in order])
    meta.prefill_dtype = prefill_dtype
    out = paged_attention(q, k, v, k_cache, v_cache, meta, out_dtype=torch.float32)
    expected = torch.cat(
        [dense_reference(qs[i], full[i][0], full[i][1], computed[i]) for i in order]
    )
    tol = 1e-5 if prefill_dtype is None else 3e-2  # bf16 prefill math (AMX/AVX512-BF16 CPUs)
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol)
