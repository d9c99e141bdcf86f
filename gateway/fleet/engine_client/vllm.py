"""VllmEngine (smg-grpc-proto; ``vllm serve --grpc``) as llm.v1.

llm.v1                         VllmEngine
EngineGenerateRequest      ->  GenerateRequest (tokenized, SamplingParams, stream)
  resumed_output_token_ids ->  appended to the prompt; max/min_tokens shrink
  priority, tenant_weight  ->  kept by the gateway (fair queue, per-replica load)
  seed (uint64)            ->  seed (int32): one above 2^31-1 is refused
  speculative_decoding,    ->  refused (INVALID_ARGUMENT naming the field)
  stop_sequences
  sampling.guided          ->  the constraint oneof (same names); lark_grammar, and a
                               guided request resumed after failover, refused
EngineGenerateResponse     <-  GenerateStreamChunk / GenerateComplete
  usage.cached_prompt_tokens <- 0: the protocol has no cache salt, so the engine's
                               prefix cache is shared by every tenant and its hit
                               count would tell one tenant what others sent
EngineStats                <-  GetLoads (summed over DP ranks) + GetServerInfo
ModelInfo                  <-  GetModelInfo (+ the entry's ?model= and ?version=)
health                     <-  HealthCheck polled (+ grpc.health.v1 where offered)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from smg_grpc_proto.generated import vllm_engine_pb2 as pb  # type: ignore[import-untyped]
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as pb_grpc  # type: ignore[import-untyped]

from gateway.fleet.engine_client.base import GenerateStream, Metadata, refuse
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
from llm.v1 import common_pb2, engine_pb2

MAX_SEED = 2**31 - 1


def sampling_params(request: engine_pb2.EngineGenerateRequest, engine: str) -> pb.SamplingParams:
    """VllmEngine's sampling of an llm.v1 request (resumed tokens counted off the limits).

    Raises:
        grpc.aio.AioRpcError: INVALID_ARGUMENT for a field VllmEngine cannot carry.
    """
    check_request(request, engine)
    p = request.sampling
    _, max_tokens, min_tokens = resumed_prompt(request)
    out = pb.SamplingParams(
        temperature=p.temperature,  # 0 = greedy in both
        top_p=p.top_p or 1.0,
        top_k=p.top_k,  # 0 = off in both
        min_p=p.min_p,
        frequency_penalty=p.frequency_penalty,
        presence_penalty=p.presence_penalty,
        repetition_penalty=p.repetition_penalty or 1.0,
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        stop_token_ids=p.stop_token_ids,
        ignore_eos=p.ignore_eos,
        n=1,
    )
    if p.logprobs:
        out.logprobs = p.logprobs
    if p.HasField("seed"):
        if p.seed > MAX_SEED:
            raise refuse(
                "sampling.seed", engine, f"VllmEngine's seed is an int32 (at most {MAX_SEED})"
            )
        out.seed = p.seed
    guided = guided_constraint(request, engine)
    if guided is not None:  # the constraint oneof has llm.v1's field names
        kind, value = guided
        if kind == "choice":
            out.choice.choices.extend(value)
        elif kind == "json_object":
            out.json_object = True
        else:
            setattr(out, kind, value)
    return out


def generate_request(
    request: engine_pb2.EngineGenerateRequest,
    engine: str,
    messages: Any = pb,
    sampling: Callable[[engine_pb2.EngineGenerateRequest, str], Any] = sampling_params,
    **fields: Any,
) -> Any:
    """The VllmEngine GenerateRequest of an llm.v1 request (``messages``, ``sampling``
    and ``fields``: another protocol's of the same shape, SglangScheduler's)."""
    wire_sampling = sampling(request, engine)
    prompt, _, _ = resumed_prompt(request)
    return messages.GenerateRequest(
        request_id=request.request_id,
        tokenized=messages.TokenizedInput(input_ids=prompt),
        sampling_params=wire_sampling,
        stream=True,
        **fields,
    )


def output_logprobs(o: pb.OutputLogProbs, limit: int) -> list[common_pb2.PositionLogprobs]:
    """llm.v1 logprobs of VllmEngine's (none when not asked for)."""
    if not limit:
        return []
    out = []
    for i, token_id in enumerate(o.token_ids):
        top = o.top_logprobs[i] if i < len(o.top_logprobs) else pb.TopLogProbs()
        alts = zip(top.token_ids, top.values, strict=False)
        out.append(position_logprobs(token_id, o.token_logprobs[i], alts, limit))
    return out


def read_response(resp: pb.GenerateResponse, limit: int) -> WirePiece:
    """One VllmEngine response read out (``limit``: logprobs asked for)."""
    if resp.WhichOneof("response") == "complete":
        c = resp.complete
        return last_piece(c, c.output_ids, output_logprobs(c.output_logprobs, limit))
    chunk = resp.chunk
    return WirePiece(list(chunk.token_ids), output_logprobs(chunk.output_logprobs, limit))


def engine_stats(
    loads: Any, server: Any, version: str, max_num_seqs: int | None = None
) -> engine_pb2.EngineStats:
    """The router's EngineStats of VllmEngine's (or SglangScheduler's) loads, every DP
    rank together (``max_num_seqs`` None: the server info's, as VllmEngine has it)."""
    ranks = list(loads.loads)
    if max_num_seqs is None:
        max_num_seqs = max(0, server.max_num_seqs)
    n = max(1, len(ranks))
    return engine_pb2.EngineStats(
        num_running=sum(r.num_running_reqs for r in ranks),
        num_waiting=sum(r.num_waiting_reqs for r in ranks),
        kv_cache_usage=sum(r.token_usage for r in ranks) / n,
        prefix_cache_hit_rate=sum(r.cache_hit_rate for r in ranks) / n,
        generation_tokens_per_second=sum(r.gen_throughput for r in ranks),
        max_num_seqs=sum(r.max_running_requests for r in ranks) or max_num_seqs,
        draining=server.is_paused,
        model_version=version,
    )


class VllmClient(StandardClient):
    """A VllmEngine replica (see the module docstring for the translation)."""

    protocol = "vllm"
    pb: Any = pb  # the protocol's messages

    def __init__(self, address: str, *args: Any, **kwargs: Any) -> None:
        super().__init__(address, *args, **kwargs)
        self.stub = pb_grpc.VllmEngineStub(self.channel)
        self._eos: frozenset[int] = frozenset()

    def wire_request(self, request: engine_pb2.EngineGenerateRequest) -> Any:
        """The protocol's GenerateRequest of an llm.v1 request (refusals raised)."""
        return generate_request(request, self.engine)

    def generate(
        self, request: engine_pb2.EngineGenerateRequest, *, timeout: float, metadata: Metadata
    ) -> GenerateStream:
        wire = self.wire_request(request)
        p = request.sampling
        hold = frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else self._eos)
        call = self.stub.Generate(wire, timeout=timeout, metadata=(*metadata, *self.metadata))
        return StandardStream(
            call,
            lambda resp: read_response(resp, p.logprobs),
            request,
            hold,
            reports_cached=False,
            abort=self._abort,
        )

    def _abort(self, request_id: str) -> None:
        self.schedule_abort(
            lambda: self.stub.Abort(
                self.pb.AbortRequest(request_ids=[request_id]), timeout=5, metadata=self.metadata
            )
        )

    async def model_info(self, timeout_s: float) -> engine_pb2.ModelInfo:
        m = await self.stub.GetModelInfo(
            self.pb.GetModelInfoRequest(), timeout=timeout_s, metadata=self.metadata
        )
        eos = [e for e in m.eos_token_ids if e >= 0]
        self._eos = frozenset(eos)
        return engine_pb2.ModelInfo(
            model=self.model or m.served_model_name or m.model_path,
            version=self.version,
            max_context_length=m.max_context_length,
            vocab_size=m.vocab_size,
            eos_token_ids=eos,
            backend=self.protocol,
        )

    async def stats(self, timeout_s: float) -> engine_pb2.EngineStats:
        loads = await self.stub.GetLoads(
            self.pb.GetLoadsRequest(), timeout=timeout_s, metadata=self.metadata
        )
        server = await self.stub.GetServerInfo(
            self.pb.GetServerInfoRequest(), timeout=timeout_s, metadata=self.metadata
        )
        return engine_stats(loads, server, self.version)

    async def health_check(self, timeout_s: float) -> str:
        resp = await self.stub.HealthCheck(
            self.pb.HealthCheckRequest(), timeout=timeout_s, metadata=self.metadata
        )
        return "" if resp.healthy else f"HealthCheck says unhealthy: {resp.message}"
