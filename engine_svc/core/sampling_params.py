"""Per-request sampling parameters (the domain twin of llm.v1.EngineSamplingParams)."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine_svc.core.guided import GuidedSpec

_MAX_LOGPROBS = 20
_MAX_SEED = 2**64 - 1
# below this a temperature is greedy: logits / 1e-30 overflow fp32 and the softmax
# turns into NaN, while argmax is what such a temperature means
GREEDY_TEMPERATURE = 1e-5


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    Zero values of the proto become these defaults in the servicer's converter:
    temperature 0 = greedy, top_p 1.0 = off, top_k 0 = off, min_p 0 = off,
    repetition_penalty 1.0 = off.

    Attributes:
        max_tokens: output tokens allowed, resumed tokens included.
        temperature: 0 (or below ``GREEDY_TEMPERATURE``) means greedy (argmax).
        top_p: nucleus mass in (0, 1].
        top_k: keep the k most likely tokens; 0 = all.
        min_p: drop tokens below ``min_p * p_max``; 0 = off.
        seed: same seed gives the same tokens whatever the batch composition
            (and across replicas: the draw at output position i depends only
            on seed and i).
        repetition_penalty: HF-style, over prompt and output tokens; 1 = off.
        presence_penalty / frequency_penalty: OpenAI-style, over output tokens.
        min_tokens: EOS and stop token ids are suppressed before this many outputs.
        logprobs: top-N alternatives per position besides the chosen token;
            0 = no logprobs. Values are the model's raw log-softmax, before
            temperature and penalties (as in vLLM v1).
        stop_token_ids: extra stop ids besides the model's EOS ids.
        stop_sequences: multi-token stops; tokens that may start one are held
            back from the stream until they are resolved.
        ignore_eos: keep going past EOS.
        include_stop_in_output: keep the matched stop token(s) in the output.
        guided: constrain the output (a JSON schema, regex, grammar, ...): the
            sampler masks every token the constraint forbids, EOS is allowed only
            where the output is complete, and the request stops when the constraint
            allows nothing more; None = unconstrained.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    logprobs: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    stop_sequences: list[list[int]] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_in_output: bool = False
    guided: GuidedSpec | None = None

    @property
    def greedy(self) -> bool:
        """True when sampling is argmax."""
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        """True when any repetition/presence/frequency penalty is active."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def validate(self, vocab_size: int) -> None:
        """Check every field.

        Raises:
            ValueError: a field is out of range; the message names it and the range.
        """
        checks: list[tuple[bool, str]] = [
            (self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}"),
            (
                0.0 <= self.temperature < float("inf"),
                f"temperature must be a finite number >= 0, got {self.temperature}",
            ),
            (0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= 0, f"top_k must be >= 0 (0 = off), got {self.top_k}"),
            (0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}"),
            (
                self.repetition_penalty > 0.0,
                f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}",
            ),
            (
                -2.0 <= self.presence_penalty <= 2.0,
                f"presence_penalty must be in [-2, 2], got {self.presence_penalty}",
            ),
            (
                -2.0 <= self.frequency_penalty <= 2.0,
                f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
            ),
            (self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens}"),
            (
                self.min_tokens <= self.max_tokens,
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
            ),
            (
                0 <= self.logprobs <= _MAX_LOGPROBS,
                f"logprobs must be in [0, {_MAX_LOGPROBS}], got {self.logprobs}",
            ),
            (
                self.seed is None or 0 <= self.seed <= _MAX_SEED,
                f"seed must be in [0, 2**64), got {self.seed}",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        if self.guided is not None:
            self.guided.validate()
        for tid in self.stop_token_ids:
            if not 0 <= tid < vocab_size:
                raise ValueError(
                    f"stop_token_ids: {tid} is outside the vocabulary [0, {vocab_size})"
                )
        for seq in self.stop_sequences:
            if not seq:
                raise ValueError("stop_sequences: an empty stop sequence is not allowed")
            bad = [t for t in seq if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"stop_sequences: token {bad[0]} is outside [0, {vocab_size})")
