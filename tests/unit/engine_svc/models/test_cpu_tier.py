"""CPU tiers from the CPU's flags, the cap, and the compile flags that enforce it."""

from __future__ import annotations

import os

import pytest

from engine_svc.models import cpu_tier
from engine_svc.models.cpu_tier import TierReport, capped, compile_flags, tier_of

ZEN4 = {"sse4_2", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni"}
SPR = ZEN4 | {"amx_tile", "amx_bf16", "amx_int8"}
ICELAKE = ZEN4 - {"avx512_bf16"}
AVX2_ONLY = {"sse4_2", "avx2", "fma"}


def test_tier_of_reads_the_highest_complete_tier() -> None:
    assert tier_of(frozenset(SPR)) == "amx"
    assert tier_of(frozenset(ZEN4)) == "avx512_bf16"
    assert tier_of(frozenset(ICELAKE)) == "avx512"
    assert tier_of(frozenset(AVX2_ONLY)) == "avx2"
    assert tier_of(frozenset({"sse4_2"})) == "default"
    # AMX flags without AVX512-BF16 below them do not make an AMX tier
    assert tier_of(frozenset(ICELAKE | {"amx_tile", "amx_bf16"})) == "avx512"


def test_a_cap_lowers_never_raises() -> None:
    assert capped("amx", "native") == "amx"
    assert capped("amx", "avx512_bf16") == "avx512_bf16"
    assert capped("amx", "avx2") == "avx2"
    assert capped("avx2", "avx512_bf16") == "avx2"  # a cap above the CPU changes nothing
    with pytest.raises(ValueError, match="cpu_isa"):
        capped("amx", "sse9")


def test_compile_flags_take_away_what_is_above_the_cap() -> None:
    assert compile_flags("amx", "native") == []
    assert compile_flags("avx512_bf16", "avx512_bf16") == []
    no_amx = compile_flags("amx", "avx512_bf16")
    assert set(no_amx) == {"-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"}
    to_avx2 = compile_flags("avx512_bf16", "avx2")
    assert "-mno-avx512f" in to_avx2
    assert "-mno-avx512bf16" in to_avx2
    assert "-mno-avx512f" not in compile_flags("amx", "avx512")
    assert "-mno-avx512bf16" in compile_flags("amx", "avx512")


def test_apply_cap_sets_torch_switches_only_where_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_tier, "native_tier", lambda: "avx512_bf16")
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    monkeypatch.setenv(cpu_tier.CAP_ENV, "native")
    cpu_tier.apply_cap("avx2")
    assert os.environ[cpu_tier.CAP_ENV] == "avx2"
    assert os.environ["ATEN_CPU_CAPABILITY"] == "avx2"
    assert os.environ["ONEDNN_MAX_CPU_ISA"] == "AVX2"  # the caller's value stays
    with pytest.raises(ValueError, match="avx1024"):
        cpu_tier.apply_cap("avx1024")


def test_the_label_says_when_a_tier_is_capped() -> None:
    native = TierReport("avx512_bf16", "native", "avx512_bf16", "AVX512", "")
    assert native.label == "isa=avx512_bf16 (cpu avx512_bf16; aten AVX512, onednn native)"
    capped_run = TierReport("amx", "avx2", "avx2", "AVX2", "AVX2")
    assert capped_run.label == "isa=avx2 (capped, cpu amx; aten AVX2, onednn AVX2)"


def test_cap_env_caps_torch_only_below_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_tier, "native_tier", lambda: "amx")
    assert cpu_tier.cap_env("native") == {cpu_tier.CAP_ENV: "native"}
    assert cpu_tier.cap_env("avx512_bf16") == {
        cpu_tier.CAP_ENV: "avx512_bf16",
        "ATEN_CPU_CAPABILITY": "avx512",
        "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16",
    }
    monkeypatch.setattr(cpu_tier, "native_tier", lambda: "avx2")
    assert cpu_tier.cap_env("avx512_bf16") == {cpu_tier.CAP_ENV: "avx512_bf16"}
