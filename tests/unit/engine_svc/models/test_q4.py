"""Lossless 4-bit weights: packing keeps only exact weights, the kernels compute what
the dense bf16 weight computes, and the default model's projections all qualify."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_svc.models import ops
from engine_svc.models.linear import Linear, LinearChoice, tune_linears
from engine_svc.models.loader import load_model
from engine_svc.models.q4 import q4_pack, q4_unpack, q8_pack, q8_unpack

needs_q4 = pytest.mark.skipif(
    not ops.q4_available(), reason="the bf16 4-bit kernels need a CPU with AVX512-BF16"
)
needs_q4_f32 = pytest.mark.skipif(
    not ops.q4_available(torch.float32), reason="the fp32 4-bit kernel needs AVX2 with F16C"
)


def q4_weight(n: int, k: int, seed: int) -> torch.Tensor:
    """A weight that is exactly 4-bit per block of 32 inputs (fp16 d and m), as a
    Q4_1 GGUF dequantizes: d * q + m with q in 0..15."""
    g = torch.Generator().manual_seed(seed)
    d = (torch.rand(n, k // 32, 1, generator=g) * 0.02 + 1e-3).half().double()
    m = (-torch.rand(n, k // 32, 1, generator=g) * 0.1).half().double()
    q = torch.randint(0, 16, (n, k // 32, 32), generator=g).double()
    q[..., 0], q[..., 1] = 0, 15  # each block spans its whole range, as quantizing makes it
    return (d * q + m).float().reshape(n, k)


@given(n16=st.integers(1, 4), k32=st.integers(1, 4), seed=st.integers(0, 1000))
@settings(max_examples=25, deadline=None)
def test_pack_round_trips_a_4bit_weight_exactly(n16: int, k32: int, seed: int) -> None:
    w = q4_weight(16 * n16, 32 * k32, seed)
    packed = q4_pack(w)
    assert packed is not None
    assert packed.dtype == torch.uint8
    assert packed.shape == (n16, k32, 320)  # 0.625 bytes per weight
    assert torch.equal(q4_unpack(packed), w)


def test_pack_refuses_weights_it_would_change() -> None:
    g = torch.Generator().manual_seed(0)
    assert q4_pack(torch.randn(32, 64, generator=g)) is None  # not 4-bit: kept dense
    w = q4_weight(32, 64, 1)
    w[3, 5] += 1e-4  # one value off the block's grid
    assert q4_pack(w) is None
    assert q4_pack(q4_weight(32, 64, 2).bfloat16()) is None  # needs the exact fp32 values
    assert q4_pack(q4_weight(32, 64, 2)[:, :48]) is None  # K not whole blocks
    assert q4_pack(q4_weight(32, 64, 2)[:24]) is None  # N not whole 16-channel tiles


def test_constant_blocks_pack() -> None:
    w = q4_weight(16, 64, 3)
    w[2, :32] = 0.25  # d = 0: every q is 0
    packed = q4_pack(w)
    assert packed is not None
    assert torch.equal(q4_unpack(packed), w)


@needs_q4
@given(
    rows=st.integers(1, 40), n16=st.integers(1, 4), k32=st.integers(1, 3), seed=st.integers(0, 99)
)
@settings(max_examples=30, deadline=None)
def test_q4_linear_is_the_dense_bf16_matmul(rows: int, n16: int, k32: int, seed: int) -> None:
    """The GEMV (up to 8 rows) and the AMX path (more, N a multiple of 32) alike."""
    w = q4_weight(16 * n16, 32 * k32, seed)
    packed = q4_pack(w)
    assert packed is not None
    x = torch.randn(rows, w.shape[1], generator=torch.Generator().manual_seed(seed)).bfloat16()
    got = ops.q4_linear(x, packed)
    ref = x.float() @ w.bfloat16().float().T  # the bf16 weight, fp32 accumulation
    assert got.dtype == torch.bfloat16
    assert got.shape == (rows, w.shape[0])
    torch.testing.assert_close(got.float(), ref, atol=5e-4 * w.shape[1] ** 0.5, rtol=1e-2)


@needs_q4
def test_q4_amx_path_equals_the_bf16_amx_kernel_bit_for_bit() -> None:
    w = q4_weight(64, 96, 7)
    packed = q4_pack(w)
    assert packed is not None
    dense = Linear(w.bfloat16())
    if not dense.can_pack("amx"):
        pytest.skip("no AMX here: the 4-bit kernel runs its GEMV for every row count")
    dense.pack("amx")
    x = torch.randn(40, 96, generator=torch.Generator().manual_seed(7)).bfloat16()
    assert torch.equal(ops.q4_linear(x, packed), dense(x))  # same bf16 weights, same tiles


@needs_q4
def test_q4_linear_refuses_what_it_cannot_run() -> None:
    packed = q4_pack(q4_weight(32, 64, 4))
    assert packed is not None
    with pytest.raises(RuntimeError, match="q4_linear"):
        ops.q4_linear(torch.randn(2, 64).double(), packed)  # no kernel for fp64 rows
    with pytest.raises(RuntimeError, match="q4_linear"):
        ops.q4_linear(torch.randn(2, 32).bfloat16(), packed)  # wrong K
    with pytest.raises(RuntimeError, match="q4_linear"):
        ops.q4_linear(torch.randn(2, 64).bfloat16(), packed[:, :, :300].contiguous())


@needs_q4
def test_a_linear_serves_few_rows_from_its_4bit_copy() -> None:
    w = q4_weight(64, 64, 5)
    lin = Linear(w.bfloat16(), q4=q4_pack(w))
    assert lin.q4 is not None
    assert Linear(w.bfloat16()).q4 is None
    assert Linear(w.half(), q4=q4_pack(w)).q4 is None  # fp16 weights: no kernel runs them
    lin.skinny_max_rows = 2
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(5)).bfloat16()
    assert lin.q4 is not None
    assert torch.equal(lin(x), ops.q4_linear(x, lin.q4))
    choice = tune_linears([lin], LinearChoice(torch.bfloat16, "benchmark"))
    assert "q4-group-q4-streamed" in choice.timings_ms  # the 4-bit path was timed
    assert choice.skinny_max_rows == 0  # no projection without a 4-bit copy to tune


@needs_q4
def test_every_projection_of_the_default_model_gets_a_4bit_copy(model_dir: Path) -> None:
    """SmolLM2-135M-Instruct comes from a Q4_1 GGUF: all 120 fused projections are
    exactly 4-bit per block; the LM head (Q8_0 in the GGUF) is not."""
    model = load_model(model_dir, torch.bfloat16, "cpu", q4_weights=True)
    projections = model.linears()[:-1]
    assert len(projections) == 4 * model.config.num_hidden_layers
    assert all(lin.q4 is not None for lin in projections)
    assert model.lm_head.q4 is None
    for lin in projections[:4]:
        assert lin.q4 is not None
        assert torch.equal(q4_unpack(lin.q4).bfloat16(), lin.weight)  # what bf16 holds
    off = load_model(model_dir, torch.bfloat16, "cpu", q4_weights=False)
    assert all(lin.q4 is None for lin in off.linears())


@needs_q4_f32
def test_fp32_weights_get_the_4bit_copy_too(model_dir: Path) -> None:
    """fp32 weights (an AVX2 CPU's choice) keep the same copies: unpacked, each is
    the fp32 weight itself, and the model's decode logits match the dense path's."""
    model = load_model(model_dir, torch.float32, "cpu", q4_weights=True)
    projections = model.linears()[:-1]
    assert all(lin.q4 is not None for lin in projections)
    assert model.lm_head.q4 is None
    for lin in projections[:4]:
        assert lin.q4 is not None
        assert torch.equal(q4_unpack(lin.q4), lin.weight)  # lossless in fp32
    x = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    lin = projections[2]  # gate_up: the widest
    lin.skinny_max_rows = 8
    via_q4 = lin(x)
    lin.skinny_max_rows = 0
    torch.testing.assert_close(via_q4, lin(x), atol=1e-5, rtol=1e-4)


@needs_q4_f32
def test_an_fp32_linear_serves_few_rows_from_its_4bit_copy() -> None:
    w = q4_weight(64, 64, 6)
    lin = Linear(w, q4=q4_pack(w))
    assert lin.q4 is not None
    lin.skinny_max_rows = 4
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(6))
    assert torch.equal(lin(x), ops.q4_linear(x, lin.q4))
    torch.testing.assert_close(lin(x), x @ w.T, atol=1e-5, rtol=1e-5)


def q8_weight(n: int, k: int, seed: int) -> torch.Tensor:
    """A weight that is exactly d * q per block of 32 inputs (fp16 d, |q| <= 127), as
    a Q8_0 GGUF dequantizes (the largest magnitude of a block is q = +-127)."""
    g = torch.Generator().manual_seed(seed)
    d = (torch.rand(n, k // 32, 1, generator=g) * 1e-3 + 1e-5).half().float()
    q = torch.randint(-127, 128, (n, k // 32, 32), generator=g).float()
    q[..., 0] = 127
    return (d * q).reshape(n, k)


@given(n16=st.integers(1, 4), k32=st.integers(1, 4), seed=st.integers(0, 1000))
@settings(max_examples=25, deadline=None)
def test_8bit_pack_round_trips_a_q8_weight_exactly(n16: int, k32: int, seed: int) -> None:
    w = q8_weight(16 * n16, 32 * k32, seed)
    packed = q8_pack(w)
    assert packed is not None
    assert packed.shape == (n16, k32, 544)  # 1.0625 bytes per weight
    assert torch.equal(q8_unpack(packed), w)


def test_8bit_pack_refuses_weights_it_would_change() -> None:
    assert q8_pack(torch.randn(32, 64, generator=torch.Generator().manual_seed(0))) is None
    w = q8_weight(32, 64, 1)
    w[3, 5] *= 1.0001  # one value off the block's grid
    assert q8_pack(w) is None
    assert q8_pack(q8_weight(32, 64, 2).bfloat16()) is None
    assert q8_pack(q8_weight(32, 64, 2)[:24]) is None  # N not whole 16-channel tiles
    zero = q8_weight(16, 64, 3)
    zero[:, :32] = 0.0  # d = 0: a block of zeros packs
    packed = q8_pack(zero)
    assert packed is not None
    assert torch.equal(q8_unpack(packed), zero)


def _q4_grid(n: int, k: int) -> torch.Tensor:
    c, i = torch.arange(n)[:, None], torch.arange(k)[None, :]
    return ((c + 7 * i) % 16).float()  # every block holds 0..15: d = 1, m = 0


def _q8_grid(n: int, k: int) -> torch.Tensor:
    c, i = torch.arange(n)[:, None], torch.arange(k)[None, :]
    w = ((c * 31 + 7 * i) % 255 - 127).float()
    w[:, 0::32] = 127.0  # d = 1 in every block
    return w


# the fp32 low-bit kernels: a weight of that width, its packer, its op, an integer grid
FP32_WIDTHS = {
    "q4": (q4_weight, q4_pack, ops.q4_linear, _q4_grid),
    "q8": (q8_weight, q8_pack, ops.q8_linear, _q8_grid),
}


@needs_q4_f32
@pytest.mark.parametrize("width", list(FP32_WIDTHS))
@given(
    rows=st.integers(1, 40), n16=st.integers(1, 4), k32=st.integers(1, 3), seed=st.integers(0, 99)
)
@settings(max_examples=30, deadline=None)
def test_lowbit_linear_on_fp32_rows_is_the_dense_fp32_matmul(
    width: str, rows: int, n16: int, k32: int, seed: int
) -> None:
    """Every register-tile height (1..6 rows and the remainders) and several blocks:
    the panel (d * q + m, or d * q) is the fp32 weight bit for bit, so only the
    summation order differs from the dense product."""
    make, pack, linear, _ = FP32_WIDTHS[width]
    w = make(16 * n16, 32 * k32, seed)
    packed = pack(w)
    assert packed is not None
    x = torch.randn(rows, w.shape[1], generator=torch.Generator().manual_seed(seed))
    got = linear(x, packed)
    ref = (x.double() @ w.double().T).float()
    assert got.dtype == torch.float32
    assert got.shape == (rows, w.shape[0])
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@needs_q4_f32
@pytest.mark.parametrize("width", list(FP32_WIDTHS))
def test_lowbit_fp32_channels_land_in_their_columns(width: str) -> None:
    """Each row of x picks one input, so each output is one weight: any mix-up of the
    pair order, the lane groups or the final lane permutation puts a value in the
    wrong place, which a random product might average away."""
    _, pack, linear, grid = FP32_WIDTHS[width]
    w = grid(48, 64)
    packed = pack(w)
    assert packed is not None
    x = torch.eye(64)[:13]  # 13 rows: two full 6-row tiles and a 1-row remainder
    assert torch.equal(linear(x, packed), w.T[:13])


@needs_q4_f32
def test_q8_linear_takes_fp32_rows_only() -> None:
    packed = q8_pack(_q8_grid(16, 64))
    assert packed is not None
    with pytest.raises(RuntimeError, match="q8_linear"):
        ops.q8_linear(torch.eye(64)[:2].bfloat16(), packed)


@needs_q4_f32
def test_the_default_models_fp32_lm_head_gets_an_8bit_copy(model_dir: Path) -> None:
    """Its tied embedding comes from a Q8_0 tensor: the copy is the fp32 weight itself,
    the few-row path computes the dense logits, and the tuning times it as a group."""
    model = load_model(model_dir, torch.float32, "cpu", q4_weights=True)
    head = model.lm_head
    assert head.q8 is not None
    assert torch.equal(q8_unpack(head.q8), head.weight)
    x = torch.randn(3, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    head.skinny_max_rows = 4
    via_q8 = head(x)
    head.skinny_max_rows = 0
    torch.testing.assert_close(via_q8, head(x), atol=1e-4, rtol=1e-4)
    choice = tune_linears([head], LinearChoice(torch.float32, "benchmark"), rounds=1)
    assert "q8-group-q8-streamed" in choice.timings_ms
    assert load_model(model_dir, torch.bfloat16, "cpu", q4_weights=True).lm_head.q8 is None
