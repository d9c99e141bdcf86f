"""A FAKE of TensorRT-LLM's LLM API, over our own CPU engine: TensorRT-LLM needs an
NVIDIA GPU, which these machines do not have.

It lets the TensorRT-LLM adapter (engine_svc.backends.trtllm) run through the
backend contract suite here: the adapter's mapping of requests, its stop
handling, resumption, logprobs, stats and clean-up are tested; TensorRT-LLM
itself is not. What it copies from TensorRT-LLM 1.x, as the adapter uses it:

- ``LLM(model=..., kv_cache_config=KvCacheConfig(...), scheduler_config=..., ...)``;
- ``SamplingParams(**fields)`` refusing fields TensorRT-LLM does not have;
- ``llm.generate_async(prompt_ids, sampling_params=..., streaming=True)`` giving
  an async iterable of outputs whose ``outputs[0]`` holds the *cumulative*
  ``token_ids`` and ``logprobs`` (``[{token_id: Logprob}]`` per position) and a
  ``finish_reason`` ("stop", "length") once ``finished``; ``.abort()`` stops it;
- no notion of stop *sequences* (those need its tokenizer, off here);
- ``llm.get_stats(timeout)`` blocks up to ``timeout`` and returns iteration
  records (dicts with TensorRT-LLM's keys); ``llm.shutdown()``.
"""

from __future__ import annotations

import asyncio
import time
import types
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from engine_svc.backends.base import GenerateInput
from engine_svc.backends.native import NativeBackend
from engine_svc.core import EngineConfig, LLMEngine, SchedulerConfig
from engine_svc.core.request import FinishReason
from engine_svc.core.sampling_params import SamplingParams as OurParams

SAMPLING_FIELDS = {
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "min_tokens",
    "logprobs",
    "stop_token_ids",
    "end_id",
    "ignore_eos",
    "detokenize",
    "include_stop_str_in_output",
    "n",
    "beam_width",
}


class SamplingParams:
    def __init__(self, **kw: Any) -> None:
        unknown = set(kw) - SAMPLING_FIELDS
        if unknown:
            raise TypeError(f"SamplingParams got unexpected fields {sorted(unknown)}")
        self.__dict__.update(kw)

    def get(self, name: str, default: Any = None) -> Any:
        return self.__dict__.get(name, default)


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None


@dataclass
class CompletionOutput:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class RequestOutput:
    outputs: list[CompletionOutput]
    finished: bool = False


def _ours(sp: SamplingParams) -> OurParams:
    return OurParams(
        max_tokens=sp.get("max_tokens", 16),
        temperature=sp.get("temperature", 0.0),
        top_p=sp.get("top_p", 1.0),
        top_k=sp.get("top_k") or 0,
        min_p=sp.get("min_p") or 0.0,
        seed=sp.get("seed"),
        repetition_penalty=sp.get("repetition_penalty", 1.0),
        presence_penalty=sp.get("presence_penalty", 0.0),
        frequency_penalty=sp.get("frequency_penalty", 0.0),
        min_tokens=sp.get("min_tokens", 0),
        logprobs=sp.get("logprobs") or 0,
        stop_token_ids=list(sp.get("stop_token_ids") or []),
        ignore_eos=bool(sp.get("ignore_eos")) or sp.get("end_id") == -1,
        include_stop_in_output=bool(sp.get("include_stop_str_in_output")),
    )


class GenerationResult:
    def __init__(
        self, llm: LLM, prompt: list[int], params: SamplingParams, priority: float
    ) -> None:
        self.llm, self.prompt, self.params, self.priority = llm, prompt, params, priority
        self.aborted = False
        self._stream: Any = None

    def abort(self) -> None:
        self.aborted = True
        self.llm.aborted += 1
        if self._stream is not None:
            asyncio.get_running_loop().create_task(self._stream.aclose())

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._run()

    async def _run(self) -> AsyncIterator[RequestOutput]:
        backend = await self.llm.started()
        inp = GenerateInput(
            request_id=uuid.uuid4().hex,
            prompt_token_ids=self.prompt,
            sampling_params=_ours(self.params),
        )
        self._stream = backend.generate(inp)
        done = CompletionOutput()
        async for out in self._stream:
            done.token_ids += out.new_token_ids
            for lp in out.new_logprobs or []:
                done.logprobs.append(
                    {
                        lp.token_id: Logprob(lp.logprob, lp.rank),
                        **{
                            t: Logprob(v, i + 1)
                            for i, (t, v) in enumerate(
                                zip(lp.top_token_ids, lp.top_logprobs, strict=True)
                            )
                            if t != lp.token_id
                        },
                    }
                )
            if out.finished:
                done.finish_reason = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}.get(
                    out.finish_reason or FinishReason.ERROR, "cancelled"
                )
            yield RequestOutput(
                [CompletionOutput(list(done.token_ids), list(done.logprobs), done.finish_reason)],
                out.finished,
            )


class LLM:
    def __init__(
        self,
        model: str,
        kv_cache_config: Any,
        scheduler_config: Any,
        max_batch_size: int,
        max_num_tokens: int,
        max_seq_len: int | None = None,
        skip_tokenizer_init: bool = True,
        enable_chunked_prefill: bool = True,
        enable_iter_perf_stats: bool = False,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
    ) -> None:
        self.parallel = (tensor_parallel_size, pipeline_parallel_size)
        self.kv_cache_config, self.scheduler_config = kv_cache_config, scheduler_config
        cfg = EngineConfig(
            model_dir=model,
            dtype="float32",
            device="cpu",
            block_size=kv_cache_config.tokens_per_block,
            num_kv_blocks=128,
            scheduler=SchedulerConfig(
                max_num_seqs=max_batch_size, max_num_batched_tokens=max_num_tokens
            ),
            max_model_len=max_seq_len or 0,
            enable_prefix_caching=kv_cache_config.enable_block_reuse,
        )
        self._backend = NativeBackend(lambda: LLMEngine(cfg))
        self._started: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.priorities: list[float] = []
        self.aborted = 0
        self.stats_calls_on_loop = 0
        self._iter = 0

    async def started(self) -> NativeBackend:
        if self._started is None:
            self._loop = asyncio.get_running_loop()
            self._started = asyncio.ensure_future(self._backend.start())
        await asyncio.shield(self._started)
        return self._backend

    def generate_async(
        self,
        prompt: list[int],
        sampling_params: SamplingParams,
        streaming: bool = False,
        priority: float = 0.5,
    ) -> GenerationResult:
        assert streaming, "the adapter always streams"
        self.priorities.append(priority)
        return GenerationResult(self, list(prompt), sampling_params, priority)

    def get_stats(self, timeout: float) -> list[dict[str, Any]]:
        try:  # TensorRT-LLM's call blocks: it must never run on the event loop
            asyncio.get_running_loop()
            self.stats_calls_on_loop += 1
        except RuntimeError:
            pass
        time.sleep(timeout)  # blocks until stats arrive or time runs out
        if self._started is None or not self._started.done():
            return []
        e = self._backend.stats().engine
        self._iter += 1
        return [
            {
                "iter": self._iter,
                "numActiveRequests": e.num_running,
                "numQueuedRequests": e.num_waiting,
                "kvCacheStats": {
                    "usedNumBlocks": e.num_kv_blocks_used,
                    "maxNumBlocks": e.num_kv_blocks_total,
                },
            }
        ]

    def shutdown(self) -> None:
        if self._loop is not None and self._started is not None:
            asyncio.run_coroutine_threadsafe(self._backend.stop(), self._loop).result(60)


class _KwObject:
    def __init__(self, **kw: Any) -> None:
        self.__dict__.update(kw)


runtime = types.SimpleNamespace(
    LLM=LLM,
    SamplingParams=SamplingParams,
    llmapi=types.SimpleNamespace(
        KvCacheConfig=_KwObject,
        SchedulerConfig=_KwObject,
        CapacitySchedulerPolicy=types.SimpleNamespace(MAX_UTILIZATION="MAX_UTILIZATION"),
    ),
)
