"""TensorRT-LLM backend: the Backend protocol on TensorRT-LLM's LLM API (1.x, PyTorch backend).

Never run on these CPU-only machines: the mapping functions below (engine
config -> LLM kwargs, sampling params -> SamplingParams kwargs, streamed
outputs -> RequestOutput, iteration stats -> EngineStats) are plain Python and
unit-tested; ``TrtLlmBackend`` imports ``tensorrt_llm`` lazily, only when
selected with ``--backend trtllm``, and says clearly what is missing. Argument
names move between TensorRT-LLM 1.2 and 1.4, so everything version-specific
stays in this file.

    LLM(model_dir, skip_tokenizer_init=True,
        kv_cache_config=KvCacheConfig(dtype=<fp8 where the GPU has it, per kv_cache_dtype>,
                                      free_gpu_memory_fraction=...),
        scheduler_config=SchedulerConfig(capacity_scheduler_policy=MAX_UTILIZATION),
        enable_chunked_prefill=True, max_batch_size=..., max_num_tokens=..., max_seq_len=...,
        enable_iter_perf_stats=True)
    llm.generate_async(token_ids, SamplingParams(...), streaming=True)  # .abort() on cancel
    llm.get_stats(timeout)  # blocking: read on a worker thread by a polling task

Request checks happen once, in the engine service, for every backend
(engine_svc.core.validation); stop sequences are matched here with the native
engine's own functions (held back while they may still complete, trimmed when
they do); a failed-over stream's resumed tokens go in as prompt and shrink
max_tokens and min_tokens, so it ends within the client's original limit.

FP8 weights come from a ModelOpt FP8 checkpoint directory (its quantization
config is detected when the model loads).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import json
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

from engine_svc.backends.base import BackendUnavailableError, GenerateInput
from engine_svc.backends.streaming import open_stream, relay
from engine_svc.core.config import EngineConfig
from engine_svc.core.outputs import EngineStats, ModelInfo, RequestOutput
from engine_svc.core.sampling_params import SamplingParams
from engine_svc.stats import BackendStats, RateWindow


def trt_kv_cache_dtype(requested: str, fp8_capable: bool) -> str:
    """TensorRT-LLM's KV cache dtype for the engine config's ``kv_cache_dtype``.

    ``auto`` is FP8 where the GPU has FP8 tensor cores (compute capability 8.9 and
    up: Ada, Hopper, Blackwell), else the model's dtype (TensorRT-LLM's ``auto``);
    ``fp8`` on a GPU without FP8 is an error rather than a silent fallback.
    """
    if requested == "fp8":
        if not fp8_capable:
            raise ValueError(
                "kv_cache_dtype fp8 needs a GPU with FP8 (compute capability "
                ">= 8.9); use auto or bfloat16 here"
            )
        return "fp8"
    if requested == "auto":
        return "fp8" if fp8_capable else "auto"
    if requested == "bfloat16":
        return "auto"  # the checkpoint's dtype (bf16 for the models served here)
    raise ValueError(
        f"kv_cache_dtype {requested!r} is not available with TensorRT-LLM (auto, fp8 or bfloat16)"
    )


def llm_kwargs(cfg: EngineConfig, kv_cache_dtype: str = "fp8") -> dict[str, Any]:
    """Keyword arguments for ``tensorrt_llm.LLM`` (config classes as plain dicts);
    ``kv_cache_dtype`` as ``trt_kv_cache_dtype`` chose it."""
    return {
        "model": cfg.model_dir,
        "skip_tokenizer_init": True,
        "kv_cache_config": {
            "dtype": kv_cache_dtype,
            "enable_block_reuse": cfg.enable_prefix_caching,
            "free_gpu_memory_fraction": cfg.kv_cache_memory_fraction,
            **({"max_tokens": cfg.num_kv_blocks * cfg.block_size} if cfg.num_kv_blocks else {}),
            "tokens_per_block": cfg.block_size,
        },
        # in-flight batching that may pause requests when blocks run out, like our engine
        "scheduler_config": {"capacity_scheduler_policy": "MAX_UTILIZATION"},
        "enable_chunked_prefill": True,
        "tensor_parallel_size": cfg.tensor_parallel_size,
        "pipeline_parallel_size": cfg.pipeline_parallel_size,
        "max_batch_size": cfg.scheduler.max_num_seqs,
        "max_num_tokens": cfg.scheduler.max_num_batched_tokens,
        **({"max_seq_len": cfg.max_model_len} if cfg.max_model_len else {}),
        "enable_iter_perf_stats": True,
    }


def sampling_kwargs(
    p: SamplingParams, eos_token_ids: Sequence[int], num_resumed: int = 0
) -> dict[str, Any]:
    """Keyword arguments for ``tensorrt_llm.SamplingParams``.

    ``num_resumed`` output tokens of a failed-over stream are already produced (they
    go in as prompt): max_tokens and min_tokens shrink by as many, so the stream
    ends within the client's original max_tokens.

    Multi-token stop sequences are not passed down (TensorRT-LLM takes stop
    *strings* through its tokenizer, which is off here); the adapter matches
    them on the streamed ids (``StreamState``, by ``stop_match``) and aborts.
    """
    kw: dict[str, Any] = {
        "max_tokens": p.max_tokens - num_resumed,
        "temperature": p.temperature,
        "top_p": p.top_p,
        "top_k": p.top_k or None,
        "min_p": p.min_p or None,
        "seed": p.seed,
        "repetition_penalty": p.repetition_penalty,
        "presence_penalty": p.presence_penalty,
        "frequency_penalty": p.frequency_penalty,
        "min_tokens": max(0, p.min_tokens - num_resumed),
        "logprobs": p.logprobs or None,
        "stop_token_ids": list(p.stop_token_ids),
        "end_id": -1 if p.ignore_eos else (eos_token_ids[0] if eos_token_ids else None),
        "ignore_eos": p.ignore_eos,
        "detokenize": False,
        "include_stop_str_in_output": p.include_stop_in_output,
    }
    return {k: v for k, v in kw.items() if v is not None}


def stats_from_iteration(
    it: dict[str, Any], max_num_seqs: int, max_waiting: int, totals: dict[str, int]
) -> EngineStats:
    """EngineStats from one TensorRT-LLM iteration-stats record (a dict)."""
    kv = it.get("kvCacheStats", {})
    used, total = int(kv.get("usedNumBlocks", 0)), int(kv.get("maxNumBlocks", 0))
    ifb = it.get("inflightBatchingStats", {})
    return EngineStats(
        num_waiting=int(it.get("numQueuedRequests", 0)),
        num_running=int(it.get("numActiveRequests", 0)),
        num_kv_blocks_used=used,
        num_kv_blocks_total=total,
        kv_cache_usage=used / total if total else 0.0,
        num_preemptions_total=int(ifb.get("numPausedRequests", 0)),
        num_requests_total=totals.get("requests", 0),
        num_prompt_tokens_total=totals.get("prompt", 0),
        num_generation_tokens_total=totals.get("generation", 0),
        num_steps_total=int(it.get("iter", 0)),
        prefix_cache_queries=int(kv.get("missedBlocks", 0)) + int(kv.get("reusedBlocks", 0)),
        prefix_cache_hits=int(kv.get("reusedBlocks", 0)),
        max_num_seqs=max_num_seqs,
        max_waiting=max_waiting,
    )


def model_info_from_dir(
    model_dir: Path, cfg: EngineConfig, kv_cache_dtype: str = "fp8"
) -> ModelInfo:
    """What GetModelInfo reports, read from the checkpoint's config files;
    ``kv_cache_dtype`` as TensorRT-LLM was given it."""
    hf = json.loads((model_dir / "config.json").read_text())
    gen_path = model_dir / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.exists() else {}
    eos = gen.get("eos_token_id", hf.get("eos_token_id"))
    eos_ids = eos if isinstance(eos, list) else ([eos] if eos is not None else [])
    quant = (hf.get("quantization_config") or {}).get("quant_algo", "")
    max_len = int(hf.get("max_position_embeddings", 0))
    return ModelInfo(
        model=model_dir.name,
        backend="trtllm",
        kv_cache_dtype="fp8_e4m3"
        if kv_cache_dtype == "fp8"
        else str(hf.get("torch_dtype", "bfloat16")),
        max_context_length=min(cfg.max_model_len or max_len, max_len),
        vocab_size=int(hf.get("vocab_size", 0)),
        eos_token_ids=[int(i) for i in eos_ids],
        weight_dtype="fp8_e4m3"
        if "FP8" in str(quant).upper()
        else str(hf.get("torch_dtype", "bfloat16")),
        kv_block_size=cfg.block_size,
        device="cuda",
    )


def _import_trtllm() -> Any:
    try:
        import tensorrt_llm  # type: ignore[import-not-found]
        import tensorrt_llm.llmapi  # type: ignore[import-not-found]  # start() reads it
    except ImportError as e:
        raise BackendUnavailableError(
            "backend 'trtllm' needs the tensorrt_llm package (pip install tensorrt-llm on a "
            "machine with an NVIDIA GPU and CUDA 12/13); use --backend native elsewhere"
        ) from e
    import torch

    if not torch.cuda.is_available():
        raise BackendUnavailableError("backend 'trtllm' needs an NVIDIA GPU; none is visible")
    return tensorrt_llm


STATS_POLL_S = 0.5


def fp8_capable(torch_module: Any) -> bool:
    """True when the current GPU has FP8 tensor cores (compute capability >= 8.9)."""
    major, minor = torch_module.cuda.get_device_capability()
    return (major, minor) >= (8, 9)


class TrtLlmBackend:
    """TensorRT-LLM's LLM API behind the Backend protocol (NVIDIA GPUs only)."""

    name = "trtllm"

    def __init__(self, cfg: EngineConfig, runtime: Any = None, fp8: bool | None = None) -> None:
        """``runtime`` stands in for the ``tensorrt_llm`` module (tests run the adapter
        on a fake of its LLM API where no GPU is); ``fp8`` whether the GPU has FP8
        (None = ask torch.cuda)."""
        self._cfg = cfg
        self._runtime = runtime
        self._fp8 = fp8
        self._llm: Any = None
        self._trt: Any = None
        self._live: dict[str, Any] = {}
        self._totals = {"requests": 0, "prompt": 0, "generation": 0}
        self._stats: EngineStats | None = None
        self._info: ModelInfo | None = None
        self._rates = RateWindow()
        self._poller: asyncio.Task[None] | None = None
        self._priority_arg = False

    async def start(self) -> None:
        trt = self._runtime if self._runtime is not None else _import_trtllm()
        fp8 = self._fp8
        if fp8 is None:
            import torch

            fp8 = fp8_capable(torch)
        llmapi = trt.llmapi
        KvCacheConfig, SchedulerConfig = llmapi.KvCacheConfig, llmapi.SchedulerConfig
        CapacitySchedulerPolicy = llmapi.CapacitySchedulerPolicy
        kv_dtype = trt_kv_cache_dtype(self._cfg.kv_cache_dtype, fp8)
        kw = llm_kwargs(self._cfg, kv_dtype)
        kw["kv_cache_config"] = KvCacheConfig(**kw["kv_cache_config"])
        policy = kw["scheduler_config"]["capacity_scheduler_policy"]
        kw["scheduler_config"] = SchedulerConfig(
            capacity_scheduler_policy=getattr(CapacitySchedulerPolicy, policy)
        )
        self._trt = trt
        self._llm = await asyncio.to_thread(trt.LLM, **kw)
        self._priority_arg = "priority" in inspect.signature(self._llm.generate_async).parameters
        self._info = model_info_from_dir(Path(self._cfg.model_dir), self._cfg, kv_dtype)
        self._stats = stats_from_iteration(
            {}, self._cfg.scheduler.max_num_seqs, self._cfg.scheduler.max_waiting, self._totals
        )
        self._poller = asyncio.create_task(self._poll_stats())

    async def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            await asyncio.gather(self._poller, return_exceptions=True)
            self._poller = None
        for res in list(self._live.values()):
            res.abort()
        if self._llm is not None:
            await asyncio.to_thread(self._llm.shutdown)
            self._llm = None

    async def generate(self, inp: GenerateInput) -> AsyncIterator[RequestOutput]:
        info = self.model_info()
        state = open_stream(
            inp,
            info,
            running=self._llm is not None,
            live=self._live,
            engine="TensorRT-LLM",
            max_num_seqs=self._cfg.scheduler.max_num_seqs,
            max_waiting=self._cfg.scheduler.max_waiting,
        )
        params = self._trt.SamplingParams(
            **sampling_kwargs(inp.sampling_params, info.eos_token_ids, len(state.resumed))
        )
        prompt = [*inp.prompt_token_ids, *state.resumed]
        extra = {"priority": priority_fraction(inp.priority)} if self._priority_arg else {}
        res = self._llm.generate_async(prompt, sampling_params=params, streaming=True, **extra)
        self._live[inp.request_id] = res
        self._totals["requests"] += 1
        self._totals["prompt"] += len(prompt)

        async def close(engine_done: bool) -> None:
            self._live.pop(inp.request_id, None)
            if not engine_done:  # cancelled, or a stop sequence matched here first
                res.abort()

        outs = relay(state, res, self._totals, close)
        async with contextlib.aclosing(outs):
            async for out in outs:
                yield out

    async def abort(self, request_id: str) -> None:
        res = self._live.pop(request_id, None)
        if res is not None:
            res.abort()

    async def _poll_stats(self) -> None:
        """TensorRT-LLM's iteration stats, read on a worker thread (get_stats blocks)."""
        while True:
            try:
                records = await asyncio.to_thread(self._llm.get_stats, STATS_POLL_S)
            except Exception:  # a failed read leaves the last snapshot; try again
                records = []
            for it in records or []:
                rec = it if isinstance(it, dict) else {}
                self._stats = stats_from_iteration(
                    rec,
                    self._cfg.scheduler.max_num_seqs,
                    self._cfg.scheduler.max_waiting,
                    self._totals,
                )
            self._rates.record(self._totals["prompt"], self._totals["generation"])
            await asyncio.sleep(STATS_POLL_S)

    def stats(self) -> BackendStats:
        """The last snapshot (never blocks: a task keeps it fresh) and recent rates."""
        assert self._stats is not None, "start() first"
        t = self._totals  # this adapter's own counts are current; the snapshot lags them
        engine = dataclasses.replace(
            self._stats,
            num_requests_total=t["requests"],
            num_prompt_tokens_total=t["prompt"],
            num_generation_tokens_total=t["generation"],
        )
        return BackendStats(engine, *self._rates.rates())

    def model_info(self) -> ModelInfo:
        assert self._info is not None, "start() first"
        return self._info


def priority_fraction(priority: int) -> float:
    """llm.v1.Priority (0 unspecified, 1 LOW, 2 NORMAL, 3 CRITICAL) as TensorRT-LLM's
    request priority in [0, 1] (0.5 its default)."""
    return {1: 0.25, 3: 1.0}.get(priority, 0.5)
