"""The start-up measurements' outcome kept on disk (engine_svc.models.compute_cache)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from engine_svc.core import compute_choice
from engine_svc.core.llm_engine import LLMEngine
from engine_svc.core.sampling_params import SamplingParams
from engine_svc.models import compute_cache, cpu_kernels
from engine_svc.models.compute_cache import ComputeCache, Decision
from engine_svc.models.linear import LinearChoice
from tests.unit.engine_svc.conftest import EngineFactory, write_tiny_model


def _paths(engine: LLMEngine) -> list[tuple[int, str, bool]]:
    return [
        (lin.skinny_max_rows, lin.packing, lin.packed is not None) for lin in engine.model.linears()
    ]


def _greedy(engine: LLMEngine) -> list[int]:
    engine.add_request("r", [5, 6, 7, 8], SamplingParams(max_tokens=6, temperature=0.0))
    out: list[int] = []
    while engine.has_unfinished_requests():
        for o in engine.step():
            out.extend(o.new_token_ids)
    return out


def test_a_decision_round_trips_and_a_bad_file_is_measured_over(tmp_path: Path) -> None:
    cache = ComputeCache(tmp_path / "c", "ab" * 32)
    assert cache.load() is None
    d = Decision("bfloat16", "benchmark", "fp32 3 ms, bf16 1 ms", "onednn", 4, 16, "bfloat16")
    d.q8_max_rows = 8
    cache.store(d)
    got = cache.load()
    assert got is not None
    assert got.dtype == "bfloat16"
    assert got.q4_max_rows == 16
    assert got.q8_max_rows == 8
    assert got.measured_at > 0  # stamped when stored
    assert not list(cache.directory.glob(".tmp-*"))  # written through a renamed temp file
    cache.path.write_text("{not json")
    assert cache.load() is None
    cache.path.write_text(json.dumps({"format": 999, "dtype": "float32", "reason": "x"}))
    assert cache.load() is None
    cache.path.write_text(json.dumps({"format": compute_cache.FORMAT, "unknown": 1}))
    assert cache.load() is None


def test_the_key_follows_the_model_shape_and_the_settings(tmp_path: Path) -> None:
    a = write_tiny_model(tmp_path / "a")
    b = write_tiny_model(tmp_path / "b", seed=7)  # other weights, same shapes
    c = write_tiny_model(tmp_path / "c", intermediate_size=96)
    settings: dict[str, Any] = {"dtype": "auto", "max_num_seqs": 32}
    key = compute_cache.cache_key(str(a), settings)
    assert key == compute_cache.cache_key(str(b), settings)
    assert key != compute_cache.cache_key(str(c), settings)
    assert key != compute_cache.cache_key(str(a), settings | {"max_num_seqs": 16})


def test_resolve_dir() -> None:
    assert compute_cache.resolve_dir("") is None
    assert compute_cache.resolve_dir("auto") == compute_cache.default_dir()
    assert compute_cache.resolve_dir("/x/y") == Path("/x/y")


def test_a_second_start_applies_the_first_starts_measurements_without_timing(
    make_tiny_engine: EngineFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = make_tiny_engine(compute_cache_dir=str(tmp_path))
    assert len(list(tmp_path.glob("*.json"))) == 1
    measured = _paths(first)
    tokens = _greedy(first)

    def no_timing(*args: object, **kwargs: object) -> None:
        raise AssertionError("a cached start must not time anything")

    monkeypatch.setattr(compute_choice, "tune_linears", no_timing)
    monkeypatch.setattr(compute_choice, "choose_prefill_dtype", no_timing)
    monkeypatch.setattr(compute_choice, "choose_prefill_kernel", no_timing)
    second = make_tiny_engine(compute_cache_dir=str(tmp_path))
    assert _paths(second) == measured
    assert second.linear_choice.name == first.linear_choice.name
    assert second.model.prefill_attn_dtype == first.model.prefill_attn_dtype
    assert "cached" in second.compute_description
    assert _greedy(second) == tokens
    # other settings are another key: that start measures (and here, must fail to)
    with pytest.raises(AssertionError, match="cached start"):
        make_tiny_engine(compute_cache_dir=str(tmp_path), max_num_batched_tokens=32)
    with pytest.raises(AssertionError, match="cached start"):
        make_tiny_engine(compute_cache_dir="")  # no cache: always measured


def test_the_cached_packing_is_the_measured_one(
    make_tiny_engine: EngineFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decision that names a packing packs every projection it applies to, as the
    tuning leaves them (written by hand: which packing wins depends on the CPU)."""
    probe = make_tiny_engine(compute_cache_dir="")
    lin = probe.model.linears()[0]
    packing = next((p for p in ("amx", "onednn") if lin.can_pack(p)), "")
    if not packing:
        pytest.skip("this CPU and torch build pack no weights (no oneDNN bf16/fp32 reorder)")
    first = make_tiny_engine(compute_cache_dir=str(tmp_path))
    (path,) = tmp_path.glob("*.json")
    raw = json.loads(path.read_text())
    raw.update(packing=packing, skinny_max_rows=2)
    path.write_text(json.dumps(raw))
    second = make_tiny_engine(compute_cache_dir=str(tmp_path))
    assert {(x.packing, x.skinny_max_rows) for x in second.model.linears()} == {(packing, 2)}
    assert second.linear_choice.packed
    assert second.linear_choice.packing == packing
    x = torch.randn(8, lin.weight.shape[1])
    torch.testing.assert_close(
        second.model.linears()[0](x), first.model.linears()[0](x), rtol=1e-4, atol=1e-4
    )


@pytest.mark.parametrize(
    ("measured_at_load", "load_now", "expected"),
    [
        (1.0, 0.2, False),  # measured on a quiet machine: kept
        (9.0, 1.5, True),  # measured oversubscribed, quiet now: measured again
        (9.0, 6.0, False),  # still busy: the busy choice fits the machine as it is
        (3.0, 1.6, False),  # quieter, but not by half
        (2.0, 0.1, False),  # as many runnable threads as CPUs is not oversubscribed
    ],
)
def test_a_choice_measured_on_a_busy_machine_is_measured_again_once_it_is_quiet(
    measured_at_load: float, load_now: float, expected: bool
) -> None:
    decision = Decision(dtype="bfloat16", reason="benchmark", load_average=measured_at_load)
    assert compute_cache.remeasure(decision, load_now, cpus=2) is expected


def test_a_start_on_a_quieter_machine_replaces_a_busy_machines_choice(
    make_tiny_engine: EngineFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    make_tiny_engine(compute_cache_dir=str(tmp_path))
    (path,) = tmp_path.glob("*.json")
    raw = json.loads(path.read_text())
    raw["load_average"] = 64.0
    path.write_text(json.dumps(raw))
    monkeypatch.setattr(compute_cache, "load_average", lambda: 0.0)
    engine = make_tiny_engine(compute_cache_dir=str(tmp_path))
    assert "cached" not in engine.compute_description
    assert json.loads(path.read_text())["load_average"] == 0.0


def test_auto_kv_is_bf16_beside_chosen_fp32_weights_and_fp32_beside_forced_fp32(
    make_tiny_engine: EngineFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the compiled kernels read a bf16 cache at fp32 math: half the bytes a decode reads
    kernels = cpu_kernels.ops_available()
    forced = make_tiny_engine()  # dtype float32, kv auto: fp32 as vLLM's auto keeps it
    assert forced.model_info().kv_cache_dtype == "float32"
    for weights in (torch.float32, torch.bfloat16):
        got = compute_choice.kv_cache_dtype("auto", weights, torch.float32, kernels)
        assert got == (torch.bfloat16 if kernels or weights == torch.bfloat16 else torch.float32)
    assert compute_choice.kv_cache_dtype("float32", torch.float32, torch.float32, True) == (
        torch.float32
    )
    # the start-up measurement chose fp32 (as it does on an AVX2 CPU)
    monkeypatch.setattr(
        compute_choice,
        "choose_linear",
        lambda *a: LinearChoice(torch.float32, "benchmark"),
    )
    chosen = make_tiny_engine(dtype="auto")
    assert chosen.linear_choice.dtype == torch.float32
    assert chosen.model_info().kv_cache_dtype == ("bfloat16" if kernels else "float32")
    assert len(_greedy(chosen)) == len(_greedy(forced))  # a bf16 cache serves whole requests
