"""What the scheduler decided for one step (the model runner's input)."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine_svc.core.request import Request


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step.

    Attributes:
        request: the request (its tokens ``[num_computed_tokens, +num_new_tokens)`` run).
        num_computed_tokens: tokens already in the cache when the step starts.
        num_new_tokens: tokens computed this step (1 for a decode).
        block_ids: the request's block table covering all of them.
        sample: True when this chunk reaches the last known token, so the
            step samples a new token for it (a partial prefill chunk does not).
        spec_token_ids: draft tokens appended after the last known token; the
            step computes them too and returns logits for ``1 + len`` rows.
    """

    request: Request
    num_computed_tokens: int
    num_new_tokens: int
    block_ids: list[int]
    sample: bool
    spec_token_ids: list[int] = field(default_factory=list)

    @property
    def input_token_ids(self) -> list[int]:
        """The tokens this step feeds the model: the scheduled slice plus drafts."""
        c = self.num_computed_tokens
        n = self.num_new_tokens - len(self.spec_token_ids)
        return self.request.all_token_ids[c : c + n] + self.spec_token_ids

    @property
    def num_logit_rows(self) -> int:
        """Rows of logits this entry gets: 0 (partial prefill), 1, or 1 + drafts."""
        return 1 + len(self.spec_token_ids) if self.sample else 0

    @property
    def is_decode(self) -> bool:
        """A single new token on top of a non-empty cache."""
        return self.num_new_tokens == 1 and self.num_computed_tokens > 0


@dataclass(slots=True)
class SchedulerOutput:
    """The step's batch, decodes first, plus what changed since the last step.

    Attributes:
        scheduled: requests of the batch; all decodes precede all prefill chunks.
        num_scheduled_tokens: total new tokens (<= max_num_batched_tokens).
        preempted_req_ids: requests preempted (blocks freed) in this step.
        num_preempted_for_room: how many of them made room for a more urgent
            request (the rest were preempted for lack of blocks).
    """

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_scheduled_tokens: int = 0
    preempted_req_ids: list[str] = field(default_factory=list)
    num_preempted_for_room: int = 0

    @property
    def short_of_blocks(self) -> bool:
        """This step preempted a request for lack of KV blocks."""
        return len(self.preempted_req_ids) > self.num_preempted_for_room

    @property
    def is_empty(self) -> bool:
        """Nothing to run."""
        return not self.scheduled

    @property
    def num_decodes(self) -> int:
        """Number of leading decode entries."""
        n = 0
        for s in self.scheduled:
            if not s.is_decode:
                break
            n += 1
        return n
