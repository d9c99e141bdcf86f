"""``vllm.grpc.engine.VllmEngine`` (smg-grpc-proto) over this engine's backend.

Translation functions (proto <-> domain) first, then the servicer. What the request
asks that this engine cannot apply (n > 1, logit_bias, prompt
logprobs, media, KV transfer, another data-parallel rank, text input) is refused
with INVALID_ARGUMENT naming the field; nothing is dropped silently.

Streaming follows the stock vLLM servicer: each chunk carries the new token ids
(``completion_tokens`` is that chunk's count; a client adds them up), then one
GenerateComplete. The Complete carries every output token id and the totals, as the
proto documents, in both modes; ``stream=false`` sends only the Complete.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from datetime import UTC, datetime
from typing import Any

import grpc
from smg_grpc_proto.generated import (  # type: ignore[import-untyped]
    common_pb2,
    vllm_engine_pb2,
    vllm_engine_pb2_grpc,
)

from common.server import Context
from engine_svc.backends.base import GenerateInput
from engine_svc.core.guided import GuidedSpec
from engine_svc.core.outputs import ModelInfo, RequestOutput
from engine_svc.core.request import TokenLogprobs
from engine_svc.core.sampling_params import SamplingParams
from engine_svc.service import reject
from engine_svc.standard.kv_events import kv_event_stream
from engine_svc.standard.shared import (
    StandardEngine,
    Step,
    finish_name,
    unimplemented,
    unsupported,
)
from engine_svc.stats import BackendStats

PROTOCOL = "VllmEngine"
SERVICE_NAME = vllm_engine_pb2.DESCRIPTOR.services_by_name["VllmEngine"].full_name
SERVER_TYPE = "llm-serving-stack-grpc"


def _refuse_unsupported(req: vllm_engine_pb2.GenerateRequest) -> None:
    p = req.sampling_params
    checks: list[tuple[bool, str, str]] = [
        (req.HasField("kv_transfer_params"), "kv_transfer_params", "no KV transfer"),
        (req.HasField("kv_transfer_params_json"), "kv_transfer_params_json", "no KV transfer"),
        (req.HasField("mm_inputs"), "mm_inputs", "a text-only model"),
        (len(req.extra_mm_inputs) > 0, "extra_mm_inputs", "a text-only model"),
        (req.HasField("media_refs"), "media_refs", "a text-only model"),
        (
            req.HasField("data_parallel_rank") and req.data_parallel_rank != 0,
            "data_parallel_rank",
            "one data-parallel rank, 0",
        ),
        (p.n > 1, "sampling_params.n", "one sequence per request"),
        (len(p.logit_bias) > 0, "sampling_params.logit_bias", ""),
        (p.HasField("prompt_logprobs"), "sampling_params.prompt_logprobs", ""),
        (p.HasField("truncate_prompt_tokens"), "sampling_params.truncate_prompt_tokens", ""),
        (
            p.HasField("logprobs") and p.logprobs < 0,
            "sampling_params.logprobs",
            "-1 (every token) is not offered; ask for 0..20",
        ),
    ]
    for bad, field, why in checks:
        if bad:
            raise unsupported(PROTOCOL, field, why)


def guided_from_vllm(p: vllm_engine_pb2.SamplingParams) -> GuidedSpec | None:
    """The constraint of VllmEngine's ``constraint`` oneof (None when unset)."""
    kind = p.WhichOneof("constraint")
    if kind is None or (kind == "json_object" and not p.json_object):
        return None
    if kind == "choice":
        return GuidedSpec.choice(p.choice.choices)
    if kind == "json_object":
        return GuidedSpec("json_object")
    return GuidedSpec(kind, getattr(p, kind))  # json_schema, regex, grammar, structural_tag


def prompt_and_limit(req: Any, info: ModelInfo, protocol: str, limit: str) -> tuple[list[int], int]:
    """A tokenized request's prompt and output limit (the sampling field ``limit``; unset,
    whatever the context leaves, as vLLM and SGLang do).

    Raises:
        ValueError: no request id, or no prompt token.
    """
    if not req.request_id:
        raise ValueError(f"{protocol}: request_id must be set")
    if not req.HasField("tokenized") or not req.tokenized.input_ids:
        raise ValueError(f"{protocol}: tokenized.input_ids is empty: send at least one token")
    prompt = list(req.tokenized.input_ids)
    p = req.sampling_params
    if p.HasField(limit):
        return prompt, int(getattr(p, limit))
    return prompt, max(1, info.max_context_length - len(prompt))


def generate_input_from_vllm(
    req: vllm_engine_pb2.GenerateRequest, info: ModelInfo
) -> tuple[GenerateInput, list[str]]:
    """The request in domain terms and its stop strings.

    Raises:
        ValueError: a field is missing, malformed or not supported (the message names it).
    """
    if req.WhichOneof("input") == "text":
        raise unsupported(PROTOCOL, "text", "send tokenized.input_ids; the gateway tokenizes")
    prompt, max_tokens = prompt_and_limit(req, info, PROTOCOL, "max_tokens")
    _refuse_unsupported(req)
    p = req.sampling_params
    asked = p.logprobs if p.HasField("logprobs") else None
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=p.temperature if p.HasField("temperature") else 1.0,  # vLLM's default
        top_p=p.top_p or 1.0,
        top_k=p.top_k,
        min_p=p.min_p,
        seed=p.seed if p.HasField("seed") else None,
        repetition_penalty=p.repetition_penalty or 1.0,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        min_tokens=p.min_tokens,
        # vLLM's 0 = the chosen token's logprob only; the engine's 0 = none
        logprobs=0 if asked is None else max(1, asked),
        stop_token_ids=list(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        include_stop_in_output=p.include_stop_str_in_output,
        guided=guided_from_vllm(p),
    )
    inp = GenerateInput(request_id=req.request_id, prompt_token_ids=prompt, sampling_params=params)
    return inp, list(p.stop)


def output_logprobs(
    lps: Sequence[TokenLogprobs] | None, top: int, pb: Any = vllm_engine_pb2
) -> Any:
    """OutputLogProbs for these positions, ``top`` alternatives each (None without any);
    ``pb``: the protocol's messages (SglangScheduler's have the same shape)."""
    if not lps:
        return None
    msg = pb.OutputLogProbs(
        token_logprobs=[lp.logprob for lp in lps], token_ids=[lp.token_id for lp in lps]
    )
    if top > 0:
        msg.top_logprobs.extend(
            pb.TopLogProbs(values=lp.top_logprobs[:top], token_ids=lp.top_token_ids[:top])
            for lp in lps
        )
    return msg


def chunk_from_output(
    out: RequestOutput, top: int, completion_tokens: int | None = None, pb: Any = vllm_engine_pb2
) -> Any:
    """One streamed chunk: the new token ids (and their logprobs); ``completion_tokens``
    None = this chunk's count (vLLM's), else the total so far (SGLang's)."""
    count = len(out.new_token_ids) if completion_tokens is None else completion_tokens
    return pb.GenerateResponse(
        chunk=pb.GenerateStreamChunk(
            token_ids=out.new_token_ids,
            prompt_tokens=out.num_prompt_tokens,
            completion_tokens=count,
            cached_tokens=out.num_cached_tokens,
            output_logprobs=output_logprobs(out.new_logprobs, top, pb),
        )
    )


def complete_from_output(
    out: RequestOutput,
    output_ids: Sequence[int],
    lps: Sequence[TokenLogprobs],
    top: int | None,
    matched_stop: str | None,
    pb: Any = vllm_engine_pb2,
) -> Any:
    """The final message: every output token id, the finish reason and the counts."""
    done = pb.GenerateComplete(
        output_ids=output_ids,
        finish_reason=finish_name(out.finish_reason),
        prompt_tokens=out.num_prompt_tokens,
        completion_tokens=len(output_ids),
        cached_tokens=out.num_cached_tokens,
        output_logprobs=output_logprobs(lps, top, pb) if top is not None else None,
        spec_draft_tokens=out.num_draft_tokens,
        spec_accepted_tokens=out.num_accepted_tokens,
    )
    if matched_stop is not None:
        done.matched_stop_str = matched_stop
    elif out.stop_token_id is not None:
        done.matched_token_id = out.stop_token_id
    return pb.GenerateResponse(complete=done)


def loads_from_stats(s: BackendStats, block_size: int, pb: Any = vllm_engine_pb2) -> Any:
    """One rank's load from the engine's own stats snapshot."""
    e = s.engine
    return pb.SchedulerLoad(
        dp_rank=0,
        num_running_reqs=e.num_running,
        num_waiting_reqs=e.num_waiting,
        num_total_reqs=e.num_running + e.num_waiting,
        num_used_tokens=e.num_kv_blocks_used * block_size,
        max_total_num_tokens=e.num_kv_blocks_total * block_size,
        token_usage=e.kv_cache_usage,
        gen_throughput=s.generation_tokens_per_second,
        cache_hit_rate=e.prefix_cache_hit_rate,
        utilization=e.num_running / e.max_num_seqs if e.max_num_seqs else 0.0,
        max_running_requests=e.max_num_seqs,
    )


def add_to_server(servicer: VllmEngineServicer, server: grpc.aio.Server) -> None:
    """Register ``servicer`` on ``server``."""
    vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(servicer, server)


class VllmEngineServicer(vllm_engine_pb2_grpc.VllmEngineServicer):  # type: ignore[misc]
    """VllmEngine over the engine's backend (``StandardEngine``).

    ``protocol`` names it in messages and ``pb`` holds its messages: SglangScheduler,
    whose messages share these shapes, is this servicer with its own translation."""

    protocol = PROTOCOL
    pb: Any = vllm_engine_pb2

    def __init__(self, engine: StandardEngine) -> None:
        self._e = engine
        self._started = time.time()

    def translate(
        self, request: Any, info: ModelInfo
    ) -> tuple[GenerateInput, list[str], int | None]:
        """The request in domain terms, its stop strings and the logprobs asked for
        (None = none)."""
        inp, stop = generate_input_from_vllm(request, info)
        p = request.sampling_params
        return inp, stop, p.logprobs if p.HasField("logprobs") else None

    def chunk(self, out: RequestOutput, top: int, num_sent: int) -> Any:
        """One streamed chunk (``num_sent``: output tokens so far, this chunk's too)."""
        return chunk_from_output(out, top)

    async def Generate(
        self, request: vllm_engine_pb2.GenerateRequest, context: Context
    ) -> AsyncIterator[vllm_engine_pb2.GenerateResponse]:
        e = self._e
        try:
            inp, stop, top = self.translate(request, e.backend.model_info())
            stops = e.stop_strings(self.protocol, stop, inp.sampling_params.min_tokens)
        except ValueError as err:
            await reject(context, grpc.StatusCode.INVALID_ARGUMENT, str(err), "invalid")
        ids: list[int] = []
        lps: list[TokenLogprobs] = []
        step: Step
        async for step in e.run(inp, stops, context):
            out = step.out
            ids.extend(out.new_token_ids)
            lps.extend(out.new_logprobs or ())
            if request.stream and out.new_token_ids:
                yield self.chunk(out, top or 0, len(ids))
            if out.finished:
                yield complete_from_output(out, ids, lps, top, step.matched_stop, self.pb)

    async def Abort(
        self, request: vllm_engine_pb2.AbortRequest, context: Context
    ) -> vllm_engine_pb2.AbortResponse:
        await self._e.abort(list(request.request_ids))
        return vllm_engine_pb2.AbortResponse()

    async def HealthCheck(
        self, request: vllm_engine_pb2.HealthCheckRequest, context: Context
    ) -> Any:
        if self._e.engine.draining:
            return self.pb.HealthCheckResponse(healthy=False, message="draining")
        return self.pb.HealthCheckResponse(healthy=True, message="serving")

    async def GetModelInfo(
        self, request: vllm_engine_pb2.GetModelInfoRequest, context: Context
    ) -> Any:
        info = self._e.backend.model_info()
        hf = self._e.hf_config
        return self.pb.GetModelInfoResponse(
            model_path=self._e.model_dir,
            is_generation=True,
            max_context_length=info.max_context_length,
            vocab_size=info.vocab_size,
            supports_vision=False,
            served_model_name=self._e.model_name,
            tokenizer_path=self._e.model_dir if self._e.bundle else "",
            model_type=str(hf.get("model_type") or ""),
            architectures=[str(a) for a in hf.get("architectures") or ()],
            eos_token_ids=info.eos_token_ids,
            pad_token_id=int(hf.get("pad_token_id") or 0),
            bos_token_id=int(hf.get("bos_token_id") or 0),
            max_req_input_len=info.max_context_length - 1,
        )

    async def GetServerInfo(
        self, request: vllm_engine_pb2.GetServerInfoRequest, context: Context
    ) -> vllm_engine_pb2.GetServerInfoResponse:
        info = self._e.backend.model_info()
        s = self._e.backend.stats().engine
        return vllm_engine_pb2.GetServerInfoResponse(
            active_requests=s.num_running + s.num_waiting,
            is_paused=self._e.engine.draining,
            uptime_seconds=time.time() - self._started,
            server_type=SERVER_TYPE,
            data_parallel_size=1,
            kv_cache_dtype=info.kv_cache_dtype,
            block_size=info.kv_block_size,
            model_dtype=info.weight_dtype,
            max_num_seqs=s.max_num_seqs,
        )

    async def GetLoads(self, request: vllm_engine_pb2.GetLoadsRequest, context: Context) -> Any:
        if request.HasField("dp_rank") and request.dp_rank != 0:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{self.protocol}: dp_rank {request.dp_rank}: this engine has one rank, 0",
            )
        block_size = self._e.backend.model_info().kv_block_size
        load = loads_from_stats(self._e.backend.stats(), block_size, self.pb)
        return self.pb.GetLoadsResponse(
            timestamp=datetime.now(UTC).isoformat(),
            version=self._e.build,
            dp_rank_count=1,
            loads=[load],
        )

    async def GetTokenizer(
        self, request: common_pb2.GetTokenizerRequest, context: Context
    ) -> AsyncIterator[common_pb2.GetTokenizerChunk]:
        async for data, sha in self._e.tokenizer_chunks(self.protocol, context):
            yield common_pb2.GetTokenizerChunk(data=data, sha256=sha)

    async def Embed(
        self, request: vllm_engine_pb2.EmbedRequest, context: Context
    ) -> vllm_engine_pb2.EmbedResponse:
        await unimplemented(context, self.protocol, "Embed", "a generation model, no embeddings")
        raise AssertionError("unreachable")

    async def FlushCache(
        self, request: common_pb2.FlushCacheRequest, context: Context
    ) -> common_pb2.FlushCacheResponse:
        await unimplemented(context, self.protocol, "FlushCache", "no flush on demand")
        raise AssertionError("unreachable")

    async def StartProfile(
        self, request: common_pb2.StartProfileRequest, context: Context
    ) -> common_pb2.ProfileResponse:
        await unimplemented(context, self.protocol, "StartProfile", "no profiler behind this API")
        raise AssertionError("unreachable")

    async def StopProfile(
        self, request: common_pb2.StopProfileRequest, context: Context
    ) -> common_pb2.ProfileResponse:
        await unimplemented(context, self.protocol, "StopProfile", "no profiler behind this API")
        raise AssertionError("unreachable")

    async def SubscribeKvEvents(
        self, request: common_pb2.SubscribeKvEventsRequest, context: Context
    ) -> AsyncIterator[common_pb2.KvEventBatch]:
        # vLLM requests carry no salt: a salted block (another protocol's) is reported
        # under its salt, so an unsalted lookup never takes it for its own
        async for batch in kv_event_stream(self._e, request, context, self.protocol, str):
            yield batch
