"""What the engine hands back: per-request step outputs, stats, model info."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine_svc.core.request import FinishReason, TokenLogprobs


@dataclass(slots=True)
class RequestOutput:
    """New tokens of one request since its previous output.

    Attributes:
        new_token_ids: tokens to stream (possibly empty on the final output).
        new_logprobs: one entry per new token when logprobs were asked for.
        finish_reason: set on the final output only.
        stop_token_id: the EOS / stop id that ended the request, if any.
        num_prompt_tokens: tokens of the original prompt.
        num_cached_tokens: prompt tokens served from the prefix cache.
        num_output_tokens: output so far, resumed tokens included.
        num_resumed_tokens: outputs inherited from another replica.
        num_draft_tokens / num_accepted_tokens: speculative drafts proposed and
            accepted so far; each accepted draft saved one forward pass.
        arrival_time / first_scheduled_time / first_token_time / finished_time:
            engine-clock seconds (monotonic), None until they happen.
    """

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    finished: bool = False
    finish_reason: FinishReason | None = None
    stop_token_id: int | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    num_resumed_tokens: int = 0
    num_preemptions: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None


STEP_PHASES = ("schedule", "prepare", "forward", "sample", "update")


@dataclass(slots=True)
class StepTimings:
    """Seconds one ``LLMEngine.step`` spent in each phase, and what it ran.

    Attributes:
        schedule: choosing the step's requests and allocating KV slots.
        prepare: building input ids, positions and attention metadata.
        forward: the model (decoder + LM head rows that sample).
        sample: turning logits into tokens (and logprobs).
        update: appending tokens, stop checks, freeing, building outputs.
        num_decodes / num_prefill_tokens: the step's batch.
    """

    schedule: float = 0.0
    prepare: float = 0.0
    forward: float = 0.0
    sample: float = 0.0
    update: float = 0.0
    num_decodes: int = 0
    num_prefill_tokens: int = 0

    def phases(self) -> dict[str, float]:
        """Phase name -> seconds, in step order."""
        return {p: getattr(self, p) for p in STEP_PHASES}


@dataclass(slots=True)
class EngineStats:
    """A snapshot of the engine's load and totals since start."""

    num_waiting: int
    num_running: int
    num_kv_blocks_used: int
    num_kv_blocks_total: int
    kv_cache_usage: float
    num_preemptions_total: int
    num_requests_total: int
    num_prompt_tokens_total: int
    num_generation_tokens_total: int
    num_steps_total: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    max_num_seqs: int
    max_waiting: int
    num_draft_tokens_total: int = 0
    num_accepted_tokens_total: int = 0
    prefix_cache_evictions: int = 0
    num_fair_share_tenants: int = 0  # tenants the fair-share counters track (live ones)
    num_step_interrupts_total: int = 0  # steps run between two layers of another step

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Hit tokens over queried tokens since start, 0 when nothing was queried."""
        return (
            self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
        )


@dataclass(slots=True)
class ModelInfo:
    """What GetModelInfo reports about the loaded model and engine."""

    model: str
    max_context_length: int
    vocab_size: int
    eos_token_ids: list[int] = field(default_factory=list)
    weight_dtype: str = "float32"
    kv_cache_dtype: str = "float32"
    kv_block_size: int = 16
    num_kv_blocks: int = 0
    device: str = "cpu"
    backend: str = "native"
    compute: str = ""
