"""``sglang.grpc.scheduler.SglangScheduler`` (smg-grpc-proto; SGLang's ``--grpc-mode``)
over this engine's backend.

Its messages share VllmEngine's shapes (stream chunk, complete, logprobs, loads, model
info, health), so the servicer is ``VllmEngineServicer`` with SGLang's translation:

- sampling: SGLang's names (``max_new_tokens``, ``min_new_tokens``, ``top_k`` -1 = off,
  ``no_stop_trim`` = keep the stop in the output), the ``constraint`` oneof (regex,
  json_schema, ebnf_grammar, structural_tag), logprobs by ``return_logprob`` and
  ``top_logprobs_num`` (``logprob_start_len`` -1); the protocol carries no seed
  (requests are unseeded) and no cache salt (its requests share the unsalted prefix
  cache);
- ``skip_special_tokens`` / ``spaces_between_special_tokens`` steer detokenization,
  which the client does: accepted, no effect on token ids; ``stream_interval`` is
  accepted and every step's tokens are streamed (a finer interval, never fewer tokens);
- refused with INVALID_ARGUMENT naming the field: n > 1, logit_bias, custom_params,
  prompt logprobs (``logprob_start_len`` >= 0 with ``return_logprob``, as SGLang reads
  it; ``token_ids_logprob``), hidden states, media and input embeddings,
  disaggregation, a custom logit processor, LoRA, another data-parallel rank;
- stream chunks carry cumulative counts, as the proto says; Abort takes one id;
  LoRA adapters cannot be loaded (none are listed).
"""

from __future__ import annotations

import time
from typing import Any

from smg_grpc_proto.generated import (  # type: ignore[import-untyped]
    sglang_scheduler_pb2,
    sglang_scheduler_pb2_grpc,
)

from common.server import Context
from engine_svc.backends.base import GenerateInput
from engine_svc.core.guided import GuidedSpec
from engine_svc.core.outputs import ModelInfo, RequestOutput
from engine_svc.core.sampling_params import SamplingParams
from engine_svc.standard.shared import unimplemented, unsupported
from engine_svc.standard.vllm_engine import (
    VllmEngineServicer,
    chunk_from_output,
    prompt_and_limit,
)

PROTOCOL = "SglangScheduler"
SERVICE_NAME = sglang_scheduler_pb2.DESCRIPTOR.services_by_name["SglangScheduler"].full_name
_GUIDES = {
    "regex": "regex",
    "json_schema": "json_schema",
    "ebnf_grammar": "grammar",
    "structural_tag": "structural_tag",
}


def _refuse_unsupported(req: Any) -> None:
    p = req.sampling_params
    checks: list[tuple[bool, str, str]] = [
        (req.HasField("mm_inputs"), "mm_inputs", "a text-only model"),
        (len(req.input_embeds) > 0, "input_embeds", "token ids only"),
        (req.return_hidden_states, "return_hidden_states", ""),
        (req.HasField("disaggregated_params"), "disaggregated_params", "no KV transfer"),
        (bool(req.custom_logit_processor), "custom_logit_processor", ""),
        (bool(req.lora_id), "lora_id", "no LoRA adapters"),
        (
            req.HasField("data_parallel_rank") and req.data_parallel_rank != 0,
            "data_parallel_rank",
            "one data-parallel rank, 0",
        ),
        (
            req.return_logprob and req.logprob_start_len >= 0,
            "logprob_start_len",
            "no prompt logprobs: send -1",
        ),
        (len(req.token_ids_logprob) > 0, "token_ids_logprob", ""),
        (p.n > 1, "sampling_params.n", "one sequence per request"),
        (len(p.logit_bias) > 0, "sampling_params.logit_bias", ""),
        (p.HasField("custom_params"), "sampling_params.custom_params", ""),
        (req.top_logprobs_num < 0, "top_logprobs_num", "ask for 0..20"),
    ]
    for bad, field, why in checks:
        if bad:
            raise unsupported(PROTOCOL, field, why)


def guided_from_sglang(p: Any) -> GuidedSpec | None:
    """The constraint of SGLang's ``constraint`` oneof (None when unset)."""
    kind = p.WhichOneof("constraint")
    return None if kind is None else GuidedSpec(_GUIDES[kind], getattr(p, kind))


def generate_input_from_sglang(req: Any, info: ModelInfo) -> tuple[GenerateInput, list[str]]:
    """The request in domain terms and its stop strings.

    Raises:
        ValueError: a field is missing, malformed or not supported (the message names it).
    """
    prompt, max_tokens = prompt_and_limit(req, info, PROTOCOL, "max_new_tokens")
    _refuse_unsupported(req)
    p = req.sampling_params
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=p.temperature,  # 0 = greedy
        top_p=p.top_p or 1.0,
        top_k=max(0, p.top_k),  # SGLang's -1 = off = the engine's 0
        min_p=p.min_p,
        repetition_penalty=p.repetition_penalty or 1.0,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        min_tokens=p.min_new_tokens,
        logprobs=max(1, req.top_logprobs_num) if req.return_logprob else 0,
        stop_token_ids=list(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        include_stop_in_output=p.no_stop_trim,
        guided=guided_from_sglang(p),
    )
    inp = GenerateInput(request_id=req.request_id, prompt_token_ids=prompt, sampling_params=params)
    return inp, list(p.stop)


def add_to_server(servicer: SglangSchedulerServicer, server: Any) -> None:
    """Register ``servicer`` on ``server``."""
    sglang_scheduler_pb2_grpc.add_SglangSchedulerServicer_to_server(servicer, server)


class SglangSchedulerServicer(VllmEngineServicer):
    """SglangScheduler over the engine's backend (see the module docstring)."""

    protocol = PROTOCOL
    pb = sglang_scheduler_pb2

    def translate(
        self, request: Any, info: ModelInfo
    ) -> tuple[GenerateInput, list[str], int | None]:
        inp, stop = generate_input_from_sglang(request, info)
        return inp, stop, request.top_logprobs_num if request.return_logprob else None

    def chunk(self, out: RequestOutput, top: int, num_sent: int) -> Any:
        return chunk_from_output(out, top, num_sent, self.pb)

    async def Abort(self, request: Any, context: Context) -> Any:
        await self._e.abort([request.request_id])
        return self.pb.AbortResponse(
            success=True, message=f"abort of {request.request_id!r} requested"
        )

    async def GetServerInfo(self, request: Any, context: Context) -> Any:
        s = self._e.backend.stats().engine
        return self.pb.GetServerInfoResponse(
            active_requests=s.num_running + s.num_waiting,
            is_paused=self._e.engine.draining,
            uptime_seconds=time.time() - self._started,
            server_type="grpc",
            max_total_num_tokens=s.num_kv_blocks_total * self._e.backend.model_info().kv_block_size,
        )

    async def LoadLoRAAdapter(self, request: Any, context: Context) -> Any:
        await unimplemented(context, PROTOCOL, "LoadLoRAAdapter", "no LoRA adapters")
        raise AssertionError("unreachable")

    async def UnloadLoRAAdapter(self, request: Any, context: Context) -> Any:
        await unimplemented(context, PROTOCOL, "UnloadLoRAAdapter", "no LoRA adapters")
        raise AssertionError("unreachable")

    async def ListLoadedLoRAAdapters(self, request: Any, context: Context) -> Any:
        return self.pb.ListLoadedLoRAAdaptersResponse()
