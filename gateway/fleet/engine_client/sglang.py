"""SglangScheduler (smg-grpc-proto; SGLang's ``--grpc-mode``) as llm.v1.

Its messages share VllmEngine's shapes (stream chunk and complete, logprobs, loads,
model info, health), so the client is ``VllmClient`` with SGLang's request:

llm.v1                         SglangScheduler
EngineGenerateRequest      ->  GenerateRequest (tokenized, SamplingParams, stream)
  resumed_output_token_ids ->  appended to the prompt; max/min_new_tokens shrink
  max_tokens, min_tokens   ->  max_new_tokens, min_new_tokens
  top_k 0 (off)            ->  top_k -1 (SGLang's off)
  include_stop_in_output   ->  no_stop_trim
  logprobs N               ->  return_logprob, top_logprobs_num N
  sampling.guided          ->  the constraint oneof: json_schema, regex, grammar as
                               ebnf_grammar, structural_tag; json_object as the schema
                               {"type": "object"}, choice as an EBNF grammar; Lark and a
                               guided request resumed after failover refused
  seed                     ->  refused (INVALID_ARGUMENT): the protocol has no seed
  priority, tenant_weight  ->  kept by the gateway (fair queue, per-replica load)
  speculative_decoding,    ->  refused
  stop_sequences
EngineGenerateResponse     <-  GenerateStreamChunk / GenerateComplete (the chunks'
                               counts are cumulative here: only token ids are read)
  usage.cached_prompt_tokens <- 0: no cache salt on the protocol (shared prefix cache)
EngineStats                <-  GetLoads (summed over DP ranks) + GetServerInfo.is_paused
prefix-aware routing       <-  SubscribeKvEvents (unsalted)
"""

from __future__ import annotations

import json
from typing import Any

from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb  # type: ignore[import-untyped]
from smg_grpc_proto.generated import (  # type: ignore[import-untyped]
    sglang_scheduler_pb2_grpc as pb_grpc,
)

from gateway.fleet.engine_client import vllm
from gateway.fleet.engine_client.base import refuse
from gateway.fleet.engine_client.standard import check_request, guided_constraint, resumed_prompt
from gateway.fleet.engine_client.vllm import VllmClient, engine_stats
from llm.v1 import engine_pb2

_ANY_OBJECT = '{"type": "object"}'
_GUIDES = {
    "json_schema": "json_schema",
    "regex": "regex",
    "grammar": "ebnf_grammar",
    "structural_tag": "structural_tag",
}


def sampling_params(request: engine_pb2.EngineGenerateRequest, engine: str) -> pb.SamplingParams:
    """SglangScheduler's sampling of an llm.v1 request (resumed tokens counted off).

    Raises:
        grpc.aio.AioRpcError: INVALID_ARGUMENT for a field SglangScheduler cannot carry.
    """
    check_request(request, engine)
    p = request.sampling
    if p.HasField("seed"):
        raise refuse("sampling.seed", engine, "SglangScheduler's sampling has no seed")
    _, max_tokens, min_tokens = resumed_prompt(request)
    out = pb.SamplingParams(
        temperature=p.temperature,  # 0 = greedy in both
        top_p=p.top_p or 1.0,
        top_k=p.top_k or -1,
        min_p=p.min_p,
        frequency_penalty=p.frequency_penalty,
        presence_penalty=p.presence_penalty,
        repetition_penalty=p.repetition_penalty or 1.0,
        max_new_tokens=max_tokens,
        min_new_tokens=min_tokens,
        stop_token_ids=p.stop_token_ids,
        ignore_eos=p.ignore_eos,
        no_stop_trim=p.include_stop_in_output,
        n=1,
    )
    guided = guided_constraint(request, engine)
    if guided is not None:
        kind, value = guided
        if kind == "json_object":
            out.json_schema = _ANY_OBJECT
        elif kind == "choice":
            out.ebnf_grammar = "root ::= " + " | ".join(json.dumps(c) for c in value)
        else:
            setattr(out, _GUIDES[kind], value)
    return out


def generate_request(request: engine_pb2.EngineGenerateRequest, engine: str) -> Any:
    """The SglangScheduler GenerateRequest of an llm.v1 request."""
    return vllm.generate_request(
        request,
        engine,
        pb,
        sampling_params,
        return_logprob=request.sampling.logprobs > 0,
        top_logprobs_num=request.sampling.logprobs,
        logprob_start_len=-1,  # no prompt logprobs
    )


class SglangClient(VllmClient):
    """A SglangScheduler replica (see the module docstring for the translation)."""

    protocol = "sglang"
    pb = pb

    def __init__(self, address: str, *args: Any, **kwargs: Any) -> None:
        super().__init__(address, *args, **kwargs)
        self.stub = pb_grpc.SglangSchedulerStub(self.channel)

    def wire_request(self, request: engine_pb2.EngineGenerateRequest) -> Any:
        return generate_request(request, self.engine)

    def _abort(self, request_id: str) -> None:
        self.schedule_abort(
            lambda: self.stub.Abort(
                pb.AbortRequest(request_id=request_id, reason="cancelled by the gateway"),
                timeout=5,
                metadata=self.metadata,
            )
        )

    async def stats(self, timeout_s: float) -> engine_pb2.EngineStats:
        loads = await self.stub.GetLoads(
            pb.GetLoadsRequest(), timeout=timeout_s, metadata=self.metadata
        )
        server = await self.stub.GetServerInfo(
            pb.GetServerInfoRequest(), timeout=timeout_s, metadata=self.metadata
        )
        # no max_num_seqs in its server info: the ranks' max running requests say it
        return engine_stats(loads, server, self.version, max_num_seqs=0)
