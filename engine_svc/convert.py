"""Static converters between llm.v1 engine messages and the engine's domain types."""

from __future__ import annotations

import time

from engine_svc.backends.base import GenerateInput
from engine_svc.core.guided import GuidedSpec
from engine_svc.core.outputs import ModelInfo, RequestOutput
from engine_svc.core.request import FinishReason, TokenLogprobs
from engine_svc.core.sampling_params import SamplingParams
from llm.v1 import common_pb2, engine_pb2

_FINISH = {
    FinishReason.STOP: common_pb2.STOP,
    FinishReason.LENGTH: common_pb2.LENGTH,
    FinishReason.ABORT: common_pb2.CANCELLED,
    FinishReason.ERROR: common_pb2.ERROR,
}


def guided_from_proto(g: common_pb2.GuidedDecoding) -> GuidedSpec | None:
    """The constraint of an llm.v1 GuidedDecoding (None when none is set)."""
    kind = g.WhichOneof("constraint")
    if kind is None:
        return None
    if kind == "choice":
        return GuidedSpec.choice(g.choice.choices)
    if kind == "json_object":
        if not g.json_object:
            return None  # false: no constraint
        return GuidedSpec("json_object")
    return GuidedSpec(kind, getattr(g, kind))


def sampling_params_from_proto(p: engine_pb2.EngineSamplingParams) -> SamplingParams:
    """Proto zero values become the documented defaults (0 temperature = greedy, ...)."""
    if p.max_tokens == 0:
        raise ValueError("sampling.max_tokens must be >= 1 (the engine needs an output budget)")
    return SamplingParams(
        max_tokens=p.max_tokens,
        temperature=p.temperature,
        top_p=p.top_p or 1.0,
        top_k=p.top_k,
        min_p=p.min_p,
        seed=p.seed if p.HasField("seed") else None,
        repetition_penalty=p.repetition_penalty or 1.0,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        min_tokens=p.min_tokens,
        logprobs=p.logprobs,
        stop_token_ids=list(p.stop_token_ids),
        stop_sequences=[list(s.token_ids) for s in p.stop_sequences],
        ignore_eos=p.ignore_eos,
        include_stop_in_output=p.include_stop_in_output,
        guided=guided_from_proto(p.guided),
    )


def generate_input_from_proto(
    req: engine_pb2.EngineGenerateRequest, served_model: str
) -> GenerateInput:
    """Validate what the proto alone can tell; the engine validates the rest."""
    if not req.request_id:
        raise ValueError("request_id must be set (the gateway generates one per request)")
    if not req.prompt_token_ids:
        raise ValueError("prompt_token_ids is empty: send at least one token")
    if req.model and req.model != served_model:
        raise ValueError(f"this replica serves {served_model!r}, not {req.model!r}")
    return GenerateInput(
        request_id=req.request_id,
        prompt_token_ids=list(req.prompt_token_ids),
        sampling_params=sampling_params_from_proto(req.sampling),
        priority=int(req.priority),
        tenant_id=req.tenant_id,
        tenant_weight=req.tenant_weight or 1.0,  # checked with the rest (validate_request)
        cache_salt=req.cache_salt,
        resumed_output_token_ids=list(req.resumed_output_token_ids),
        speculative_decoding=(
            req.speculative_decoding if req.HasField("speculative_decoding") else None
        ),
    )


def deadline_seconds(
    req: engine_pb2.EngineGenerateRequest, grpc_remaining: float | None
) -> float | None:
    """Seconds left under the earlier of the request's deadline and the gRPC deadline."""
    left = [grpc_remaining] if grpc_remaining is not None else []
    if req.HasField("deadline") and (req.deadline.seconds or req.deadline.nanos):
        left.append(req.deadline.seconds + req.deadline.nanos * 1e-9 - time.time())
    return min(left) if left else None


def _logprobs(lps: list[TokenLogprobs]) -> list[common_pb2.PositionLogprobs]:
    return [
        common_pb2.PositionLogprobs(
            chosen=common_pb2.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob),
            rank=lp.rank,
            top=[
                common_pb2.TokenLogprob(token_id=t, logprob=v)
                for t, v in zip(lp.top_token_ids, lp.top_logprobs, strict=True)
            ],
        )
        for lp in lps
    ]


def _timings(out: RequestOutput, now: float) -> engine_pb2.Timings:
    t = engine_pb2.Timings(e2e_seconds=now - out.arrival_time, num_preemptions=out.num_preemptions)
    if out.first_scheduled_time is not None:
        t.queue_seconds = out.first_scheduled_time - out.arrival_time
    if out.first_token_time is not None:
        t.time_to_first_token_seconds = out.first_token_time - out.arrival_time
    return t


def response_from_output(
    out: RequestOutput, first: bool, now: float
) -> engine_pb2.EngineGenerateResponse:
    """One streamed chunk; timings on the first and last, usage on the last."""
    resp = engine_pb2.EngineGenerateResponse(request_id=out.request_id, token_ids=out.new_token_ids)
    if out.new_logprobs:
        resp.logprobs.extend(_logprobs(out.new_logprobs))
    if first or out.finished:
        resp.timings.CopyFrom(_timings(out, now))
    if out.finished:
        resp.finish_reason = _FINISH.get(out.finish_reason or FinishReason.ERROR, common_pb2.ERROR)
        resp.usage.CopyFrom(
            common_pb2.Usage(
                prompt_tokens=out.num_prompt_tokens,
                completion_tokens=out.num_output_tokens,
                cached_prompt_tokens=out.num_cached_tokens,
            )
        )
        if out.stop_token_id is not None:
            resp.stop_token_id = out.stop_token_id
        if out.num_draft_tokens:
            resp.speculative.CopyFrom(
                engine_pb2.SpeculativeStats(
                    num_draft_tokens=out.num_draft_tokens,
                    num_accepted_tokens=out.num_accepted_tokens,
                    num_forward_passes_saved=out.num_accepted_tokens,
                )
            )
    return resp


def model_info_to_proto(
    info: ModelInfo,
    *,
    version: str,
    config_hash: str,
    build: str,
    served_model: str,
    tokenizer_digest: str = "",
) -> engine_pb2.ModelInfo:
    return engine_pb2.ModelInfo(
        model=served_model,
        version=version,
        max_context_length=info.max_context_length,
        vocab_size=info.vocab_size,
        eos_token_ids=info.eos_token_ids,
        weight_dtype=info.weight_dtype,
        kv_cache_dtype=info.kv_cache_dtype,
        backend=info.backend,
        kv_block_size=info.kv_block_size,
        config_hash=config_hash,
        engine_build=build,
        device=info.device,
        compute=info.compute,
        tokenizer_digest=tokenizer_digest,
    )
