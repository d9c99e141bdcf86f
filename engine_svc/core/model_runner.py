"""Runs the model for a scheduled step: input tensors, KV cache, logits."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from engine_svc.core.config import EngineConfig
from engine_svc.core.request import Request
from engine_svc.core.sched_output import SchedulerOutput
from engine_svc.models import kv_fp8
from engine_svc.models.attention import build_attention_metadata
from engine_svc.models.config import ModelConfig
from engine_svc.models.llama import LlamaForCausalLM

_GIB = 1 << 30
logger = logging.getLogger(__name__)


def available_memory_bytes(device: torch.device) -> int:
    """Free memory on ``device``: free GPU memory, or MemAvailable on CPU."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))


# the default budget holds at most every running sequence at this many tokens (a request
# may still run to max_model_len: the pool is shared, and the floor fits one such request)
KV_CAP_TOKENS_PER_SEQ = 2048


def kv_budget_bytes(
    available: int, fraction: float, per_token: int, max_num_seqs: int, max_model_len: int
) -> tuple[int, str]:
    """The default KV budget: ``fraction`` of ``available`` memory, raised to the floor
    and lowered to the cap, and which of the three decided.

    - floor: one request of ``max_model_len`` tokens fits (at most half of ``available``)
    - cap: ``max_num_seqs`` sequences of ``min(max_model_len, KV_CAP_TOKENS_PER_SEQ)``
      tokens each: the batch the scheduler runs at a working length, not the whole
      machine (a 135M model does not hold gigabytes on a laptop)

    Args:
        available: free bytes (CPU MemAvailable or free GPU memory).
        fraction: ``kv_cache_memory_fraction``.
        per_token: KV bytes per token of the model in the cache dtype.
        max_num_seqs, max_model_len: the scheduler's limits.

    Returns:
        (bytes, ``fraction`` | ``floor`` | ``cap``)
    """
    want = int(available * fraction)
    floor = min(max_model_len * per_token, available // 2)
    cap = max(max_num_seqs * min(max_model_len, KV_CAP_TOKENS_PER_SEQ) * per_token, floor)
    if want < floor:
        return floor, "floor"
    if want > cap:
        return cap, "cap"
    return want, "fraction"


def determine_num_blocks(
    config: EngineConfig, model_config: ModelConfig, kv_dtype: torch.dtype, device: torch.device
) -> int:
    """Pool size: explicit ``num_kv_blocks``, else the byte budget (explicit
    ``kv_cache_memory_bytes``, else ``kv_budget_bytes``) over the bytes per block.

    Raises:
        ValueError: the budget does not hold a single block.
    """
    if config.num_kv_blocks > 0:
        return config.num_kv_blocks
    per_token = model_config.kv_bytes_per_token(kv_dtype.itemsize)
    per_block = per_token * config.block_size
    budget, why = config.kv_cache_memory_bytes, "kv_cache_memory_bytes"
    if budget <= 0:
        sched = config.scheduler_config(model_config.max_position_embeddings)
        available = available_memory_bytes(device)
        budget, why = kv_budget_bytes(
            available, config.kv_cache_memory_fraction, per_token,
            sched.max_num_seqs, sched.max_model_len,
        )  # fmt: skip
        why = f"{why} of {available / _GIB:.1f} GiB available"
    num_blocks = budget // per_block
    if num_blocks < 1:
        raise ValueError(
            f"KV cache budget of {budget / _GIB:.3f} GiB holds no {per_block}-byte block; "
            "raise kv_cache_memory_bytes or kv_cache_memory_fraction"
        )
    logger.info(
        "KV cache: %.2f GiB (%s), %d blocks, %d tokens",
        num_blocks * per_block / _GIB, why, num_blocks, num_blocks * config.block_size,
    )  # fmt: skip
    return int(num_blocks)


class ModelRunner:
    """Owns the model and its paged KV cache and executes scheduled steps.

    Cache layout per layer (flat over blocks so a slot id indexes it directly)::

        kv_cache[layer, 0 | 1] : [num_blocks, block_size, num_kv_heads, head_dim]
        slot = block_id * block_size + offset   (the flat view writes by slot)

    Args:
        model: the model.
        num_blocks: blocks in the pool.
        block_size: tokens per block.
        kv_cache_dtype: None = the attention dtype; ``torch.float8_e4m3fn`` =
            FP8 cache with per-layer, per-head scales calibrated at start.
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        num_blocks: int,
        block_size: int,
        kv_cache_dtype: torch.dtype | None = None,
    ) -> None:
        self.model = model
        self.device = model.device
        self.block_size = block_size
        self.num_blocks = num_blocks
        cfg = model.config
        # zeros, not empty: padded reads of unused slots must stay finite
        self.kv_cache = torch.zeros(
            cfg.num_hidden_layers,
            2,
            num_blocks,
            block_size,
            cfg.num_key_value_heads,
            cfg.head_dim,
            dtype=kv_cache_dtype or model.attn_dtype,
            device=self.device,
        )
        self.kv_caches = [(layer[0], layer[1]) for layer in self.kv_cache]
        self.kv_scales: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.last_prepare_s = 0.0  # input building of the latest step
        self.last_forward_s = 0.0  # decoder + LM head of the latest step
        if self.kv_cache.dtype == torch.float8_e4m3fn:
            self.kv_scales = self._calibrate_kv_scales()

    @torch.inference_mode()
    def _calibrate_kv_scales(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer, per-head K/V scales from one prefill into a scratch fp32 cache."""
        cfg = self.model.config
        tokens = kv_fp8.calibration_token_ids(cfg.vocab_size)
        nblk = -(-len(tokens) // self.block_size)
        shape = (cfg.num_hidden_layers, 2, nblk, self.block_size, cfg.num_key_value_heads)
        scratch = torch.zeros(*shape, cfg.head_dim, dtype=self.model.attn_dtype, device=self.device)
        meta, positions = build_attention_metadata(
            [0], [len(tokens)], [list(range(nblk))], 0, self.block_size, self.device
        )
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device)
        self.model.forward(ids, positions, meta, [(c[0], c[1]) for c in scratch])
        amax = scratch.abs().amax(dim=(2, 3, 5))  # [layers, 2, Hkv]
        scales = kv_fp8.scales_from_amax(amax)
        return [(layer[0].contiguous(), layer[1].contiguous()) for layer in scales]

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes held by the KV cache tensors."""
        return self.kv_cache.numel() * self.kv_cache.element_size()

    @torch.inference_mode()
    def execute_model(
        self, output: SchedulerOutput, between_layers: Callable[[], None] | None = None
    ) -> tuple[torch.Tensor, list[Request]]:
        """Run one step; ``between_layers`` is called between two layers of the model
        (it may run a nested step: see ``LLMEngine.step``).

        Returns:
            fp32 logits [N, vocab] for the rows that sample this step (one per
            sampling entry, ``1 + drafts`` for a speculative one) and each
            row's request in the same order.
        """
        t0 = time.perf_counter()
        entries = output.scheduled
        token_ids: list[int] = []
        for e in entries:
            token_ids += e.input_token_ids
        meta, positions = build_attention_metadata(
            [e.num_computed_tokens for e in entries],
            [e.num_new_tokens for e in entries],
            [e.block_ids for e in entries],
            output.num_decodes,
            self.block_size,
            self.device,
        )
        meta.prefill_dtype = self.model.prefill_attn_dtype
        meta.prefill_kernel = self.model.prefill_attn_kernel
        input_ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        t1 = time.perf_counter()
        hidden = self.model.forward(
            input_ids, positions, meta, self.kv_caches, self.kv_scales, between_layers
        )
        last_rows: list[int] = []
        sampled: list[Request] = []
        end = 0
        for e in entries:
            end += e.num_new_tokens
            rows = e.num_logit_rows  # 1 + drafts for a speculative entry
            last_rows.extend(range(end - rows, end))
            sampled.extend([e.request] * rows)
        if not last_rows:
            logits = hidden.new_empty((0, self.model.config.vocab_size), dtype=torch.float32)
        else:
            if len(last_rows) < hidden.shape[0]:
                hidden = hidden[torch.tensor(last_rows, device=self.device)]
            logits = self.model.compute_logits(hidden)
        # set after the forward: a nested step inside it sets its own first
        self.last_prepare_s, self.last_forward_s = t1 - t0, time.perf_counter() - t1
        return logits, sampled
