"""TrtllmService (smg-grpc-proto; ``trtllm-serve --grpc``) as llm.v1.

llm.v1                         TrtllmService
EngineGenerateRequest      ->  GenerateRequest (tokenized, SamplingConfig,
                               OutputConfig, max_tokens, streaming)
  resumed_output_token_ids ->  appended to the prompt; max/min_tokens shrink
  cache_salt               ->  cache_salt_id (its int64 digest): the tenant's or its
                               cache group's salt, so tenants never share prefix-cache
                               blocks and each one's cached-token count is its own
  priority, tenant_weight  ->  kept by the gateway (fair queue, per-replica load)
  speculative_decoding,    ->  refused (INVALID_ARGUMENT naming the field)
  stop_sequences
  include_stop_in_output   ->  include_stop_token_in_output
  sampling.guided          ->  guided_decoding (json_object as the schema {"type":
                               "object"}, choice as an EBNF grammar); lark_grammar, and
                               a guided request resumed after failover, refused
EngineGenerateResponse     <-  GenerateStreamChunk / GenerateComplete (cached tokens
                               reported: the cache is salted per tenant)
EngineStats                <-  no load RPC on this protocol: the load records of
                               SubscribeKvEvents (running, waiting, KV usage, rate,
                               max running) while fresh; without them only
                               max_num_seqs (GetModelInfo's max batch size), and the
                               router weighs the gateway's own calls in flight
prefix-aware routing       <-  SubscribeKvEvents (cache_salt: cache_salt_id in decimal)
ModelInfo                  <-  GetModelInfo (max_seq_len; + ?model= and ?version=)
health                     <-  HealthCheck polled (+ grpc.health.v1 where offered)
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from smg_grpc_proto.generated import trtllm_service_pb2 as pb  # type: ignore[import-untyped]
from smg_grpc_proto.generated import trtllm_service_pb2_grpc as pb_grpc  # type: ignore[import-untyped]

from gateway.fleet.engine_client.base import GenerateStream, Metadata
from gateway.fleet.engine_client.standard import (
    StandardClient,
    StandardStream,
    WirePiece,
    check_request,
    guided_constraint,
    last_piece,
    position_logprobs,
    resumed_prompt,
)
from gateway.fleet.engine_client.standard import cache_salt as standard_cache_salt
from llm.v1 import common_pb2, engine_pb2

LOAD_FRESH_S = 5.0  # a load record older than this (or 3 polls) is not used

_GUIDE = pb.GuidedDecodingParams
_GUIDE_TYPES = {
    "json_schema": _GUIDE.GUIDE_TYPE_JSON_SCHEMA,
    "regex": _GUIDE.GUIDE_TYPE_REGEX,
    "grammar": _GUIDE.GUIDE_TYPE_EBNF_GRAMMAR,
    "structural_tag": _GUIDE.GUIDE_TYPE_STRUCTURAL_TAG,
}
_ANY_OBJECT = '{"type": "object"}'  # the protocol's GUIDE_TYPE_JSON is any JSON value


def guided_decoding(
    request: engine_pb2.EngineGenerateRequest, engine: str
) -> pb.GuidedDecodingParams | None:
    """TrtllmService's guided_decoding of an llm.v1 constraint: a JSON object as the schema
    ``{"type": "object"}``, a choice as the EBNF grammar ``root ::= "a" | "b"``."""
    guided = guided_constraint(request, engine)
    if guided is None:
        return None
    kind, value = guided
    if kind == "json_object":
        return _GUIDE(guide_type=_GUIDE.GUIDE_TYPE_JSON_SCHEMA, guide=_ANY_OBJECT)
    if kind == "choice":
        options = " | ".join(json.dumps(c, ensure_ascii=False) for c in value)
        return _GUIDE(guide_type=_GUIDE.GUIDE_TYPE_EBNF_GRAMMAR, guide=f"root ::= {options}")
    assert isinstance(value, str)
    return _GUIDE(guide_type=_GUIDE_TYPES[kind], guide=value)


def generate_request(request: engine_pb2.EngineGenerateRequest, engine: str) -> pb.GenerateRequest:
    """The TrtllmService GenerateRequest of an llm.v1 request.

    Raises:
        grpc.aio.AioRpcError: INVALID_ARGUMENT for a field TrtllmService cannot carry.
    """
    check_request(request, engine)
    p = request.sampling
    prompt, max_tokens, min_tokens = resumed_prompt(request)
    sampling = pb.SamplingConfig(
        beam_width=1,
        num_return_sequences=1,
        temperature=p.temperature,  # 0 = greedy in both
        min_tokens=min_tokens,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
    )
    if p.top_k:  # llm.v1's zeros are "off"; unset here is the engine's off
        sampling.top_k = p.top_k
    if p.top_p:
        sampling.top_p = p.top_p
    if p.min_p:
        sampling.min_p = p.min_p
    if p.repetition_penalty:
        sampling.repetition_penalty = p.repetition_penalty
    if p.HasField("seed"):
        sampling.seed = p.seed
    output = pb.OutputConfig(exclude_input_from_output=True)
    if p.logprobs:
        output.logprobs = p.logprobs
    return pb.GenerateRequest(
        request_id=request.request_id,
        tokenized=pb.TokenizedInput(input_token_ids=prompt),
        sampling_config=sampling,
        output_config=output,
        max_tokens=max_tokens,
        streaming=True,
        cache_salt_id=standard_cache_salt(request.cache_salt) if request.cache_salt else None,
        stop_token_ids=p.stop_token_ids,
        ignore_eos=p.ignore_eos,
        include_stop_token_in_output=p.include_stop_in_output,
        guided_decoding=guided_decoding(request, engine),
    )


def logprobs(entries: Iterable[pb.TokenLogprob], limit: int) -> list[common_pb2.PositionLogprobs]:
    """llm.v1 logprobs of TrtllmService's (none when not asked for)."""
    if not limit:
        return []
    return [
        position_logprobs(
            e.token_id, e.logprob, ((t.token_id, t.logprob) for t in e.top_logprobs), limit
        )
        for e in entries
    ]


def read_response(resp: pb.GenerateResponse, limit: int) -> WirePiece:
    """One TrtllmService response read out (``limit``: logprobs asked for)."""
    if resp.WhichOneof("response") == "complete":
        c = resp.complete
        return last_piece(c, c.output_token_ids, logprobs(c.logprobs, limit))
    chunk = resp.chunk
    return WirePiece(list(chunk.token_ids), logprobs(chunk.logprobs, limit))


class TrtllmClient(StandardClient):
    """A TrtllmService replica (see the module docstring for the translation)."""

    protocol = "trtllm"

    def __init__(self, address: str, *args: Any, **kwargs: Any) -> None:
        super().__init__(address, *args, **kwargs)
        self.stub = pb_grpc.TrtllmServiceStub(self.channel)
        self._max_batch_size = 0

    def generate(
        self, request: engine_pb2.EngineGenerateRequest, *, timeout: float, metadata: Metadata
    ) -> GenerateStream:
        wire = generate_request(request, self.engine)
        limit = request.sampling.logprobs
        call = self.stub.Generate(wire, timeout=timeout, metadata=(*metadata, *self.metadata))
        return StandardStream(
            call,
            lambda resp: read_response(resp, limit),
            request,
            frozenset(),  # the engine strips stop tokens itself unless asked to keep them
            reports_cached=True,
            abort=self._abort,
        )

    def _abort(self, request_id: str) -> None:
        self.schedule_abort(
            lambda: self.stub.Abort(
                pb.AbortRequest(request_id=request_id), timeout=5, metadata=self.metadata
            )
        )

    async def model_info(self, timeout_s: float) -> engine_pb2.ModelInfo:
        m = await self.stub.GetModelInfo(
            pb.GetModelInfoRequest(), timeout=timeout_s, metadata=self.metadata
        )
        self._max_batch_size = max(0, m.max_batch_size)
        return engine_pb2.ModelInfo(
            model=self.model or m.model_id,
            version=self.version,
            max_context_length=max(0, m.max_seq_len),
            vocab_size=max(0, m.vocab_size),
            backend="trtllm",
        )

    def wire_salt(self, cache_salt: str) -> str:
        return str(standard_cache_salt(cache_salt)) if cache_salt else ""

    async def stats(self, timeout_s: float) -> engine_pb2.EngineStats:
        # a record older than a few polls is stale (the stream broke): fall back
        load = self.recent_load(max(LOAD_FRESH_S, 3 * self.poll_interval_s))
        if load is None:
            return engine_pb2.EngineStats(
                max_num_seqs=self._max_batch_size, model_version=self.version
            )
        return engine_pb2.EngineStats(
            num_running=load.running_requests,
            num_waiting=load.waiting_requests,
            kv_cache_usage=load.token_usage,
            prefix_cache_hit_rate=load.cache_hit_rate,
            generation_tokens_per_second=load.gen_throughput,
            max_num_seqs=load.max_running_requests or self._max_batch_size,
            model_version=self.version,
        )

    async def health_check(self, timeout_s: float) -> str:
        resp = await self.stub.HealthCheck(
            pb.HealthCheckRequest(), timeout=timeout_s, metadata=self.metadata
        )
        return "" if resp.status == "OK" else f"HealthCheck says {resp.status!r}"
