"""The engine service with no model behind it: ``python -m bench.gatewaylib.stub_engine``.

Everything of ``python -m engine_svc`` runs (its gRPC server and interceptors, the
servicer, request checks, metrics, the tokenizer it serves the gateway), but the
backend computes nothing: each request's tokens come back at once, one output per
token. ``bench.gateway_bench --engine stub`` puts this under both the direct side and
the gateway, so what they differ by is the gateway alone, without the model's
step-to-step jitter (tens of ms on a small CPU) in every paired difference. This is
how proxy overheads are usually published (LiteLLM's against a fake OpenAI endpoint);
it is a benchmark device, never a serving mode, and the report says which engine ran.

The tokens are the prompt's own ids, cycled: real ids of the served tokenizer, so the
gateway's detokenizer sees ordinary text. ``$STUB_FIRST_TOKEN_MS`` (0 by default) holds
each first token that long, without using the CPU, as a prefill would: then what the
gateway overlaps with the engine's start (the overlapped admission's Redis call) is
hidden as it is behind a real model, and the difference is what a user of a real engine pays.
``$STUB_TOKEN_GAP_MS`` (0 by default) spaces the later tokens that far apart, as decode
steps do: each token then reaches an idle gateway on its own (one wake-up per token, as
behind a real engine at concurrency 1), where back to back they share the wake-ups.
"""

from __future__ import annotations

import asyncio
import itertools
import os
from collections.abc import AsyncGenerator

from engine_svc.__main__ import main as engine_main
from engine_svc.backends.base import BackendUnavailableError, GenerateInput
from engine_svc.config import EngineServiceConfig
from engine_svc.core.config import EngineConfig
from engine_svc.core.outputs import EngineStats, ModelInfo, RequestOutput
from engine_svc.core.request import FinishReason
from engine_svc.stats import BackendStats


class StubBackend:
    """The Backend protocol, answering every request at once without a model."""

    name = "stub"

    def __init__(
        self, core: EngineConfig, first_token_s: float = 0.0, token_gap_s: float = 0.0
    ) -> None:
        self.first_token_s = first_token_s
        self.token_gap_s = token_gap_s
        self.max_num_seqs = core.scheduler.max_num_seqs
        self.max_context = 8192
        self.running = 0
        self.requests = 0
        self.prompt_tokens = 0
        self.generated = 0
        self.started = False

    async def start(self) -> None:
        self.started = True

    async def stop(self) -> None:
        self.started = False

    async def generate(self, inp: GenerateInput) -> AsyncGenerator[RequestOutput, None]:
        if not self.started:
            raise BackendUnavailableError("the stub engine is stopped")
        prompt = inp.prompt_token_ids
        n = inp.sampling_params.max_tokens or 16
        self.running += 1
        self.requests += 1
        self.prompt_tokens += len(prompt)
        try:
            if self.first_token_s > 0:
                await asyncio.sleep(self.first_token_s)  # a prefill's wait, not its CPU
            ids = itertools.cycle(prompt or [0])
            for i in range(n):
                last = i == n - 1
                self.generated += 1
                yield RequestOutput(
                    request_id=inp.request_id,
                    new_token_ids=[next(ids)],
                    finished=last,
                    finish_reason=FinishReason.LENGTH if last else None,
                    num_prompt_tokens=len(prompt),
                    num_output_tokens=i + 1,
                )
                # one loop turn per token at least, like a real step's output
                await asyncio.sleep(0 if last else self.token_gap_s)
        finally:
            self.running -= 1

    async def abort(self, request_id: str) -> None:
        return None

    def stats(self) -> BackendStats:
        return BackendStats(
            EngineStats(
                num_waiting=0,
                num_running=self.running,
                num_kv_blocks_used=0,
                num_kv_blocks_total=1024,
                kv_cache_usage=0.0,
                num_preemptions_total=0,
                num_requests_total=self.requests,
                num_prompt_tokens_total=self.prompt_tokens,
                num_generation_tokens_total=self.generated,
                num_steps_total=self.generated,
                prefix_cache_queries=0,
                prefix_cache_hits=0,
                max_num_seqs=self.max_num_seqs,
                max_waiting=4 * self.max_num_seqs,
            )
        )

    def model_info(self) -> ModelInfo:
        return ModelInfo(
            model="stub",
            max_context_length=self.max_context,
            vocab_size=49152,
            backend="stub",
            compute="none (bench stub: no model)",
        )


def make_stub(svc: EngineServiceConfig, core: EngineConfig) -> StubBackend:
    """The backend factory for ``engine_svc``'s main."""
    return StubBackend(
        core,
        float(os.environ.get("STUB_FIRST_TOKEN_MS", "0")) / 1000.0,
        float(os.environ.get("STUB_TOKEN_GAP_MS", "0")) / 1000.0,
    )


if __name__ == "__main__":
    engine_main(backend_factory=make_stub)
