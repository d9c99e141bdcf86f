"""The Backend protocol the engine servicer depends on, and its value types.

A backend turns ``GenerateInput`` into a stream of ``RequestOutput`` (new
token ids per step, the last one finished). The native PyTorch engine and the
vLLM adapter implement it; the servicer knows nothing else.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from engine_svc.core.outputs import ModelInfo, RequestOutput
from engine_svc.core.sampling_params import SamplingParams
from engine_svc.core.validation import validate_request
from engine_svc.stats import BackendStats


class QueueFullError(Exception):
    """The waiting queue is full; the caller should retry later or elsewhere."""

    def __init__(self, message: str, retry_after_ms: int) -> None:
        super().__init__(message)
        self.retry_after_ms = retry_after_ms


def retry_after_ms(num_waiting: int, max_num_seqs: int) -> int:
    """What a refused caller is told to wait: roughly the time for the queue ahead of
    it to drain into the running batch."""
    if max_num_seqs <= 0:
        return 1000
    return int(min(30_000, 250 * (1 + num_waiting / max_num_seqs)))


class BackendUnavailableError(Exception):
    """The backend cannot take work (stopped, failed, draining)."""


class DuplicateRequestError(Exception):
    """A live request already has this id. Nothing was registered, so the caller's
    clean-up must not touch the live request (it belongs to another call)."""


@dataclass(slots=True)
class GenerateInput:
    """One generation request in domain terms (converted from the proto).

    ``validate`` checks it against the model once: the engine service calls it before
    any backend sees the request, and a backend calls it again for a direct caller
    (free when already done). ``validated`` records that it passed.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    priority: int = 2
    tenant_id: str = ""
    tenant_weight: float = 1.0
    cache_salt: str = ""  # prefix-cache blocks are shared only under the same salt
    resumed_output_token_ids: list[int] = field(default_factory=list)
    speculative_decoding: bool | None = None
    validated: bool = field(default=False, compare=False)

    def validate(self, info: ModelInfo) -> None:
        """Raise ``ValueError`` (``validate_request``'s message) when this request can never
        run on the model ``info`` describes; once it passed, a later call does nothing."""
        if self.validated:
            return
        validate_request(
            self.request_id,
            self.prompt_token_ids,
            self.sampling_params,
            self.priority,
            self.resumed_output_token_ids,
            vocab_size=info.vocab_size,
            max_model_len=info.max_context_length,
            tenant_weight=self.tenant_weight,
        )
        self.validated = True


@runtime_checkable
class Backend(Protocol):
    """What an engine backend offers the service."""

    name: str

    async def start(self) -> None:
        """Load the model and start serving work."""

    async def stop(self) -> None:
        """Abort what is left, stop every thread, free the model."""

    def generate(self, inp: GenerateInput) -> AsyncIterator[RequestOutput]:
        """Stream outputs of one request.

        Closing the iterator early (cancel, deadline, error) aborts the request
        this call registered and frees its KV blocks; nothing else.

        Raises (on first iteration):
            ValueError: the request is invalid; the message says how to fix it.
            DuplicateRequestError: the id is in use by a live request (left untouched).
            QueueFullError: no room now; retry after ``retry_after_ms``.
            BackendUnavailableError: the backend is stopped or failed.
        """
        ...

    async def abort(self, request_id: str) -> None:
        """Abort a live request now (its KV blocks are freed); no-op if unknown."""

    def stats(self) -> BackendStats:
        """Queue lengths, KV usage, preemptions, throughput."""
        ...

    def model_info(self) -> ModelInfo:
        """Static facts about the served model."""
        ...
