"""The default KV budget: a fraction of free memory between a floor and a cap that come
from the model (bytes per token) and the scheduler (sequences, context)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine_svc.core import model_runner
from engine_svc.core.config import EngineConfig, SchedulerConfig
from engine_svc.core.model_runner import (
    KV_CAP_TOKENS_PER_SEQ,
    determine_num_blocks,
    kv_budget_bytes,
)
from engine_svc.models.config import load_model_config

GIB = 1 << 30
SMOLLM_BF16 = 23_040  # bytes per token: 30 layers x 2 x 3 KV heads x 64 x 2 bytes


def test_a_small_model_does_not_take_gigabytes_of_a_big_machine() -> None:
    budget, why = kv_budget_bytes(22 * GIB, 0.2, SMOLLM_BF16, 32, 8192)
    assert why == "cap"
    assert budget == 32 * KV_CAP_TOKENS_PER_SEQ * SMOLLM_BF16  # ~1.4 GiB, not 4.4
    # a short max_model_len lowers the cap with it
    assert kv_budget_bytes(22 * GIB, 0.2, SMOLLM_BF16, 32, 512) == (32 * 512 * SMOLLM_BF16, "cap")


def test_the_fraction_rules_between_floor_and_cap() -> None:
    per_token = 512 * 1024  # a 7B-class model in bf16
    budget, why = kv_budget_bytes(16 * GIB, 0.2, per_token, 32, 4096)
    assert (budget, why) == (int(16 * GIB * 0.2), "fraction")


def test_the_floor_fits_one_full_length_request_within_half_the_memory() -> None:
    per_token = 512 * 1024
    assert kv_budget_bytes(8 * GIB, 0.05, per_token, 32, 4096) == (4096 * per_token, "floor")
    # where even that is more than half of what is free, half is the floor
    assert kv_budget_bytes(2 * GIB, 0.05, per_token, 32, 8192) == (GIB, "floor")


def test_determine_num_blocks_explicit_budget_wins_and_default_is_capped(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mc = load_model_config(tiny_model_dir)
    per_block = mc.kv_bytes_per_token(2) * 4
    explicit = EngineConfig(kv_cache_memory_bytes=10 * per_block + 1, block_size=4)
    cpu = torch.device("cpu")
    assert determine_num_blocks(explicit, mc, torch.bfloat16, cpu) == 10
    monkeypatch.setattr(model_runner, "available_memory_bytes", lambda device: 64 * GIB)
    sched = SchedulerConfig(max_num_seqs=8)
    default = EngineConfig(block_size=4, max_model_len=64, scheduler=sched)
    max_len = min(64, mc.max_position_embeddings)
    assert determine_num_blocks(default, mc, torch.bfloat16, cpu) == 8 * max_len // 4
