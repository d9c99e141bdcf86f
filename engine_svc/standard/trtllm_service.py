"""``trtllm.TrtllmService`` (smg-grpc-proto) over this engine's backend.

Translation functions (proto <-> domain) first, then the servicer. What this engine
cannot apply (beam search, several sequences, bad words, LoRA,
prompt tuning, media, KV retention, disaggregation, lookahead, logits, prompt
logprobs) is refused with INVALID_ARGUMENT naming the field.

``cache_salt_id`` salts the prefix cache: KV blocks are reused only between requests
with the same salt (the gateway sends one per tenant or cache group).

Streaming: each chunk carries the new token ids with cumulative counts, then one
GenerateComplete with every output token id; ``streaming=false`` sends only the
Complete.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence

import grpc
from smg_grpc_proto.generated import (  # type: ignore[import-untyped]
    common_pb2,
    trtllm_service_pb2,
    trtllm_service_pb2_grpc,
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
    finish_name,
    unimplemented,
    unsupported,
)

PROTOCOL = "TrtllmService"
SALT_PREFIX = "trtllm:"  # the engine's salt of a cache_salt_id
SERVICE_NAME = trtllm_service_pb2.DESCRIPTOR.services_by_name["TrtllmService"].full_name
# optional fields of SamplingConfig this engine has no use for (any value is refused)
_SAMPLING_REFUSED = (
    "top_p_min",
    "top_p_reset_ids",
    "top_p_decay",
    "beam_search_diversity_rate",
    "prompt_ignore_length",
    "length_penalty",
    "early_stopping",
    "no_repeat_ngram_size",
)
_REQUEST_REFUSED = (
    "lora_config",
    "prompt_tuning_config",
    "multimodal_input",
    "kv_cache_retention",
    "lookahead_config",
)


def _refuse_unsupported(req: trtllm_service_pb2.GenerateRequest) -> None:
    s, o = req.sampling_config, req.output_config
    checks: list[tuple[bool, str, str]] = [
        (s.beam_width > 1, "sampling_config.beam_width", "no beam search"),
        (len(s.beam_width_array) > 0, "sampling_config.beam_width_array", "no beam search"),
        (s.num_return_sequences > 1, "sampling_config.num_return_sequences", "one sequence"),
        *((s.HasField(f), f"sampling_config.{f}", "") for f in _SAMPLING_REFUSED),
        (o.HasField("prompt_logprobs"), "output_config.prompt_logprobs", ""),
        (o.return_context_logits, "output_config.return_context_logits", ""),
        (o.return_generation_logits, "output_config.return_generation_logits", ""),
        (o.return_encoder_output, "output_config.return_encoder_output", "a decoder-only model"),
        (
            o.HasField("logprobs") and o.logprobs < 0,
            "output_config.logprobs",
            "ask for 0..20",
        ),
        *((req.HasField(f), f, "") for f in _REQUEST_REFUSED),
        (
            req.HasField("disaggregated_params")
            and req.disaggregated_params.request_type
            != trtllm_service_pb2.DisaggregatedParams.REQUEST_TYPE_CONTEXT_AND_GENERATION,
            "disaggregated_params",
            "no disaggregated prefill/decode",
        ),
        (len(req.embedding_bias) > 0, "embedding_bias", ""),
        (len(req.bad) > 0, "bad", "no bad-word suppression"),
        (len(req.bad_token_ids) > 0, "bad_token_ids", "no bad-word suppression"),
        (len(req.tokenized.query_token_ids) > 0, "tokenized.query_token_ids", ""),
    ]
    for bad, field, why in checks:
        if bad:
            raise unsupported(PROTOCOL, field, why)


_GUIDES = {
    trtllm_service_pb2.GuidedDecodingParams.GUIDE_TYPE_JSON_SCHEMA: "json_schema",
    trtllm_service_pb2.GuidedDecodingParams.GUIDE_TYPE_REGEX: "regex",
    trtllm_service_pb2.GuidedDecodingParams.GUIDE_TYPE_EBNF_GRAMMAR: "grammar",
    trtllm_service_pb2.GuidedDecodingParams.GUIDE_TYPE_STRUCTURAL_TAG: "structural_tag",
}
_ANY_JSON = "{}"  # GUIDE_TYPE_JSON: any JSON value, a schema with no constraint


def guided_from_trtllm(req: trtllm_service_pb2.GenerateRequest) -> GuidedSpec | None:
    """The constraint of TrtllmService's ``guided_decoding`` (None when unset).

    Raises:
        ValueError: an unspecified guide type (the message names the field).
    """
    if not req.HasField("guided_decoding"):
        return None
    g = req.guided_decoding
    if g.guide_type == trtllm_service_pb2.GuidedDecodingParams.GUIDE_TYPE_JSON:
        return GuidedSpec("json_schema", g.guide or _ANY_JSON)
    kind = _GUIDES.get(g.guide_type)
    if kind is None:
        raise ValueError(f"{PROTOCOL}: guided_decoding.guide_type must be set")
    return GuidedSpec(kind, g.guide)


def generate_input_from_trtllm(
    req: trtllm_service_pb2.GenerateRequest,
) -> tuple[GenerateInput, list[str]]:
    """The request in domain terms and its stop strings.

    Raises:
        ValueError: a field is missing, malformed or not supported (the message names it).
    """
    if not req.request_id:
        raise ValueError(f"{PROTOCOL}: request_id must be set")
    if not req.tokenized.input_token_ids:
        raise ValueError(f"{PROTOCOL}: tokenized.input_token_ids is empty: send at least one token")
    if req.max_tokens == 0:
        raise ValueError(f"{PROTOCOL}: max_tokens is required (>= 1)")
    _refuse_unsupported(req)
    s, o = req.sampling_config, req.output_config
    params = SamplingParams(
        max_tokens=req.max_tokens,
        temperature=s.temperature if s.HasField("temperature") else 1.0,
        top_p=s.top_p if s.HasField("top_p") and s.top_p > 0 else 1.0,
        top_k=s.top_k if s.HasField("top_k") else 0,
        min_p=s.min_p if s.HasField("min_p") else 0.0,
        seed=s.seed if s.HasField("seed") else None,
        repetition_penalty=s.repetition_penalty if s.HasField("repetition_penalty") else 1.0,
        presence_penalty=s.presence_penalty if s.HasField("presence_penalty") else 0.0,
        frequency_penalty=s.frequency_penalty if s.HasField("frequency_penalty") else 0.0,
        min_tokens=s.min_tokens if s.HasField("min_tokens") else 0,
        # 0 = the chosen token's logprob only (the engine's 0 = none)
        logprobs=max(1, o.logprobs) if o.HasField("logprobs") else 0,
        stop_token_ids=list(req.stop_token_ids),
        ignore_eos=req.ignore_eos,
        include_stop_in_output=req.include_stop_token_in_output,
        guided=guided_from_trtllm(req),
    )
    inp = GenerateInput(
        request_id=req.request_id,
        prompt_token_ids=list(req.tokenized.input_token_ids),
        sampling_params=params,
        cache_salt=f"{SALT_PREFIX}{req.cache_salt_id}" if req.HasField("cache_salt_id") else "",
    )
    return inp, list(req.stop)


def token_logprobs(
    lps: Sequence[TokenLogprobs] | None, top: int
) -> list[trtllm_service_pb2.TokenLogprob]:
    """TokenLogprob per position, ``top`` alternatives each."""
    return [
        trtllm_service_pb2.TokenLogprob(
            token_id=lp.token_id,
            logprob=lp.logprob,
            top_logprobs=[
                trtllm_service_pb2.TopLogprob(token_id=t, logprob=v)
                for t, v in zip(lp.top_token_ids[:top], lp.top_logprobs[:top], strict=True)
            ],
        )
        for lp in lps or ()
    ]


def chunk_from_output(
    out: RequestOutput, top: int, completion_tokens: int
) -> trtllm_service_pb2.GenerateResponse:
    """One streamed chunk: the new token ids; the counts so far."""
    return trtllm_service_pb2.GenerateResponse(
        request_id=out.request_id,
        chunk=trtllm_service_pb2.GenerateStreamChunk(
            token_ids=out.new_token_ids,
            prompt_tokens=out.num_prompt_tokens,
            completion_tokens=completion_tokens,
            cached_tokens=out.num_cached_tokens,
            logprobs=token_logprobs(out.new_logprobs, top),
        ),
    )


def _wall(t: float | None, now_mono: float, now_wall: float) -> float:
    return 0.0 if t is None else now_wall - (now_mono - t)


def perf_metrics(out: RequestOutput) -> trtllm_service_pb2.PerfMetrics:
    """The request's times as unix timestamps (the engine keeps monotonic ones)."""
    mono, wall = time.monotonic(), time.time()
    return trtllm_service_pb2.PerfMetrics(
        arrival_time=_wall(out.arrival_time, mono, wall),
        first_scheduled_time=_wall(out.first_scheduled_time, mono, wall),
        first_token_time=_wall(out.first_token_time, mono, wall),
        last_token_time=_wall(out.finished_time, mono, wall),
    )


def complete_from_output(
    out: RequestOutput,
    output_ids: Sequence[int],
    lps: Sequence[TokenLogprobs],
    top: int,
    matched_stop: str | None,
    perf: bool = False,
) -> trtllm_service_pb2.GenerateResponse:
    """The final message: every output token id, the finish reason and the counts."""
    done = trtllm_service_pb2.GenerateComplete(
        output_token_ids=output_ids,
        finish_reason=finish_name(out.finish_reason),
        prompt_tokens=out.num_prompt_tokens,
        completion_tokens=len(output_ids),
        cached_tokens=out.num_cached_tokens,
        logprobs=token_logprobs(lps, top),
        spec_draft_tokens=out.num_draft_tokens,
        spec_accepted_tokens=out.num_accepted_tokens,
    )
    if matched_stop is not None:
        done.matched_stop_str = matched_stop
    elif out.stop_token_id is not None:
        done.matched_token_id = out.stop_token_id
    if perf:
        done.perf_metrics.CopyFrom(perf_metrics(out))
    return trtllm_service_pb2.GenerateResponse(request_id=out.request_id, complete=done)


def model_info_response(
    info: ModelInfo, hf: dict[str, object], model_id: str, max_batch_size: int
) -> trtllm_service_pb2.GetModelInfoResponse:
    def num(key: str) -> int:
        value = hf.get(key)
        return int(value) if isinstance(value, int | float) else 0

    return trtllm_service_pb2.GetModelInfoResponse(
        model_id=model_id,
        max_input_len=info.max_context_length - 1,
        max_seq_len=info.max_context_length,
        max_batch_size=max_batch_size,
        vocab_size=info.vocab_size,
        hidden_size=num("hidden_size"),
        num_layers=num("num_hidden_layers"),
        num_heads=num("num_attention_heads"),
        supported_features=["logprobs", "stop_strings", "perf_metrics"],
    )


def wire_salt(salt: str) -> str:
    """A block's cache salt as KV events report it: a TrtllmService request's as its
    ``cache_salt_id`` in decimal; another protocol's under a prefix no id has."""
    if salt.startswith(SALT_PREFIX):
        return salt[len(SALT_PREFIX) :]
    return f"other:{salt}"


def add_to_server(servicer: TrtllmServiceServicer, server: grpc.aio.Server) -> None:
    """Register ``servicer`` on ``server``."""
    trtllm_service_pb2_grpc.add_TrtllmServiceServicer_to_server(servicer, server)


class TrtllmServiceServicer(trtllm_service_pb2_grpc.TrtllmServiceServicer):  # type: ignore[misc]
    """TrtllmService over the engine's backend (``StandardEngine``)."""

    def __init__(self, engine: StandardEngine) -> None:
        self._e = engine

    async def Generate(
        self, request: trtllm_service_pb2.GenerateRequest, context: Context
    ) -> AsyncIterator[trtllm_service_pb2.GenerateResponse]:
        e = self._e
        try:
            inp, stop = generate_input_from_trtllm(request)
            stops = e.stop_strings(PROTOCOL, stop, inp.sampling_params.min_tokens)
        except ValueError as err:
            await reject(context, grpc.StatusCode.INVALID_ARGUMENT, str(err), "invalid")
        o = request.output_config
        top = o.logprobs if o.HasField("logprobs") else 0
        ids: list[int] = []
        lps: list[TokenLogprobs] = []
        async for step in e.run(inp, stops, context):
            out = step.out
            ids.extend(out.new_token_ids)
            lps.extend(out.new_logprobs or ())
            if request.streaming and out.new_token_ids:
                yield chunk_from_output(out, top, len(ids))
            if out.finished:
                yield complete_from_output(
                    out, ids, lps, top, step.matched_stop, o.return_perf_metrics
                )

    async def Abort(
        self, request: trtllm_service_pb2.AbortRequest, context: Context
    ) -> trtllm_service_pb2.AbortResponse:
        await self._e.abort([request.request_id])
        return trtllm_service_pb2.AbortResponse(
            success=True, message=f"abort of {request.request_id!r} requested"
        )

    async def HealthCheck(
        self, request: trtllm_service_pb2.HealthCheckRequest, context: Context
    ) -> trtllm_service_pb2.HealthCheckResponse:
        status = "draining" if self._e.engine.draining else "OK"
        return trtllm_service_pb2.HealthCheckResponse(status=status)

    async def GetModelInfo(
        self, request: trtllm_service_pb2.GetModelInfoRequest, context: Context
    ) -> trtllm_service_pb2.GetModelInfoResponse:
        e = self._e
        max_batch = e.backend.stats().engine.max_num_seqs
        return model_info_response(e.backend.model_info(), e.hf_config, e.model_name, max_batch)

    async def GetServerInfo(
        self, request: trtllm_service_pb2.GetServerInfoRequest, context: Context
    ) -> trtllm_service_pb2.GetServerInfoResponse:
        info = self._e.backend.model_info()
        return trtllm_service_pb2.GetServerInfoResponse(
            version=self._e.build,
            backend=info.backend,
            tensor_parallel_size=1,
            pipeline_parallel_size=1,
            context_parallel_size=1,
            world_size=1,
        )

    async def GetTokenizer(
        self, request: common_pb2.GetTokenizerRequest, context: Context
    ) -> AsyncIterator[common_pb2.GetTokenizerChunk]:
        async for data, sha in self._e.tokenizer_chunks(PROTOCOL, context):
            yield common_pb2.GetTokenizerChunk(data=data, sha256=sha)

    async def Embed(
        self, request: trtllm_service_pb2.EmbedRequest, context: Context
    ) -> trtllm_service_pb2.EmbedResponse:
        await unimplemented(context, PROTOCOL, "Embed", "a generation model, no embeddings")
        raise AssertionError("unreachable")

    async def SubscribeKvEvents(
        self, request: common_pb2.SubscribeKvEventsRequest, context: Context
    ) -> AsyncIterator[common_pb2.KvEventBatch]:
        async for batch in kv_event_stream(self._e, request, context, PROTOCOL, wire_salt):
            yield batch
