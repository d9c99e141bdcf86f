"""Request state: tokens, progress through the cache, status and timestamps."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from engine_svc.core.block_pool import BlockHash
from engine_svc.core.guided import GuidedMatcher
from engine_svc.core.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Lifecycle of a request; every status above PREEMPTED is finished."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        """True for the FINISHED_* states."""
        return status > RequestStatus.PREEMPTED


class FinishReason(enum.StrEnum):
    """Why a request ended (maps onto llm.v1.FinishReason)."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


@dataclass(slots=True)
class TokenLogprobs:
    """Log-probabilities at one output position.

    Attributes:
        token_id / logprob / rank: the chosen token, its logprob, its 1-based rank.
        top_token_ids / top_logprobs: the top-N alternatives, best first.
    """

    token_id: int
    logprob: float
    rank: int
    top_token_ids: list[int]
    top_logprobs: list[float]


@dataclass(slots=True, eq=False)
class Request:
    """One generation request as the scheduler and engine see it.

    ``all_token_ids`` = prompt + resumed outputs + generated outputs; the cache
    holds the first ``num_computed_tokens`` of them. ``output_token_ids``
    starts with the resumed tokens (produced earlier by another replica), which
    count as output for penalties, min_tokens, stops and max_tokens but are
    never streamed again.

    Attributes:
        priority: larger is more urgent (llm.v1.Priority: LOW 1, NORMAL 2, CRITICAL 3).
        tenant_id / tenant_weight: whose request it is and that tenant's share
            (fair share between tenants within a priority class; "" = anonymous).
        cache_salt: prefix-cache blocks are reused only under the same salt.
        guided: the request's place in its output constraint (None = unconstrained);
            advanced on every accepted token, resumed ones included.
        num_streamed: output tokens handed to the caller so far.
        num_stop_tokens: length of the matched stop (id or sequence) at the end
            of the output, withheld from the stream unless include_stop_in_output.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    priority: int = 2
    eos_token_ids: tuple[int, ...] = ()
    tenant_id: str = ""
    tenant_weight: float = 1.0
    cache_salt: str = ""
    status: RequestStatus = RequestStatus.WAITING
    all_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    num_resumed_tokens: int = 0
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    num_streamed: int = 0
    num_preemptions: int = 0
    stop_token_id: int | None = None
    num_stop_tokens: int = 0
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    block_hashes: list[BlockHash] = field(default_factory=list)
    use_spec: bool = False
    spec_token_ids: list[int] = field(default_factory=list)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    guided: GuidedMatcher | None = None

    @classmethod
    def create(
        cls,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        arrival_time: float,
        priority: int = 2,
        resumed_output_token_ids: list[int] | None = None,
        eos_token_ids: tuple[int, ...] = (),
        tenant_id: str = "",
        tenant_weight: float = 1.0,
        cache_salt: str = "",
    ) -> Request:
        """Build a request; resumed tokens extend the prompt and count as output."""
        resumed = list(resumed_output_token_ids or [])
        return cls(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            sampling_params=sampling_params,
            arrival_time=arrival_time,
            priority=priority,
            eos_token_ids=eos_token_ids,
            tenant_id=tenant_id,
            tenant_weight=tenant_weight,
            cache_salt=cache_salt,
            all_token_ids=list(prompt_token_ids) + resumed,
            output_token_ids=resumed,
            num_resumed_tokens=len(resumed),
            num_streamed=len(resumed),
        )

    @property
    def num_tokens(self) -> int:
        """Prompt plus all output tokens."""
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        """Tokens of the original prompt (resumed outputs not included)."""
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Output tokens, resumed ones included (what max_tokens counts)."""
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        """True once the request reached a FINISHED_* status."""
        return RequestStatus.is_finished(self.status)

    @property
    def finish_reason(self) -> FinishReason | None:
        """The finish reason, or None while the request is live."""
        return _FINISH_REASONS.get(self.status)

    def append_output_token(self, token_id: int) -> None:
        """Record one generated token."""
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
