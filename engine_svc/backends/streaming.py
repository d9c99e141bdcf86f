"""Delta bookkeeping shared by the adapters of engines that stream cumulative output
(vLLM): deltas, stop sequences with the native engine's own rules
(held back while they may still complete, trimmed when they do), resumed tokens
of a failed-over stream, and logprobs in their common format.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterable, Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine_svc.backends.base import (
    BackendUnavailableError,
    DuplicateRequestError,
    GenerateInput,
    QueueFullError,
    retry_after_ms,
)
from engine_svc.core.outputs import ModelInfo, RequestOutput
from engine_svc.core.request import FinishReason, TokenLogprobs
from engine_svc.core.sampling_params import SamplingParams
from engine_svc.core.stop_checker import stop_holdback, stop_match


def logprobs_from_stream(
    entries: Sequence[Any], token_ids: Sequence[int], top_n: int
) -> list[TokenLogprobs]:
    """Per-position logprobs as vLLM streams them (``{token_id:
    Logprob}`` with ``.logprob`` and ``.rank``, the sampled token among them; or a bare
    float, the sampled token's alone) as our ``TokenLogprobs`` with the ``top_n`` best."""

    def value(v: Any) -> float:
        return float(getattr(v, "logprob", v))

    out = []
    for entry, tok in zip(entries, token_ids, strict=False):
        if isinstance(entry, dict):
            scored = sorted(((value(v), int(t)) for t, v in entry.items()), reverse=True)
            chosen = entry.get(tok)
            lp = value(chosen) if chosen is not None else float("-inf")
            rank = getattr(chosen, "rank", None)
            if rank is None:
                rank = 1 + sum(1 for v, _ in scored if v > lp)
            top = scored[:top_n]
        else:
            lp, rank, top = value(entry), 1, []
        out.append(
            TokenLogprobs(
                token_id=int(tok),
                logprob=lp,
                rank=int(rank),
                top_token_ids=[t for _, t in top],
                top_logprobs=[v for v, _ in top],
            )
        )
    return out


_FINISH = {
    "stop": FinishReason.STOP,
    "length": FinishReason.LENGTH,
    "cancelled": FinishReason.ABORT,
    "abort": FinishReason.ABORT,
}


@dataclass(slots=True)
class StreamState:
    """Per-request bookkeeping for an engine that streams the cumulative token ids of
    what it generates (vLLM); the client sees deltas. Stop sequences
    are matched here with the native engine's own rules (``stop_match`` /
    ``stop_holdback``): over the whole output, resumed tokens included, once
    ``min_tokens`` are out; tokens that may begin a stop sequence are held back
    until the next ones decide."""

    request_id: str
    num_prompt_tokens: int
    params: SamplingParams
    arrival_time: float
    resumed: list[int] = field(default_factory=list)
    output_ids: list[int] = field(init=False)  # resumed + generated, up to a stop
    num_sent: int = field(init=False)  # output tokens released so far
    first_token_time: float | None = None
    num_cached_tokens: int = 0  # prompt tokens the engine served from its prefix cache

    def __post_init__(self) -> None:
        self.output_ids = list(self.resumed)
        self.num_sent = len(self.resumed)  # the resumed ones went out before

    def advance(
        self,
        cumulative_ids: Sequence[int],
        finish_reason: str | None,
        now: float,
        cumulative_logprobs: Sequence[Any] | None = None,
        num_cached_tokens: int | None = None,
    ) -> RequestOutput:
        """The delta since the last call; finished when the engine finished or a stop
        sequence completed (then the caller aborts the engine's request).
        ``num_cached_tokens``: prompt tokens from the prefix cache, where the engine
        says."""
        if num_cached_tokens is not None:
            self.num_cached_tokens = num_cached_tokens
        out, stops = self.output_ids, self.params.stop_sequences
        checked = len(out)
        out.extend(cumulative_ids[checked - len(self.resumed) :])  # only what is new
        stop_len = 0
        if stops:  # each new token, as the engine would check it
            for n in range(max(checked + 1, self.params.min_tokens), len(out) + 1):
                stop_len = stop_match(out, stops, end=n)
                if stop_len:
                    del out[n:]  # anything generated past the stop is dropped
                    break
        reason = _FINISH.get(finish_reason, FinishReason.ERROR) if finish_reason else None
        if stop_len:
            reason = FinishReason.STOP
        if reason is None:
            end = len(out) - stop_holdback(out, stops)
        elif stop_len and not self.params.include_stop_in_output:
            end = len(out) - stop_len
        else:
            end = len(out)
        start, end = self.num_sent, max(self.num_sent, end)
        new = out[start:end]
        logprobs = None
        if self.params.logprobs and cumulative_logprobs is not None:
            r = len(self.resumed)  # the engine's logprobs cover what it generated
            logprobs = logprobs_from_stream(
                cumulative_logprobs[start - r : end - r], new, self.params.logprobs
            )
        self.num_sent = end
        if new and self.first_token_time is None:
            self.first_token_time = now
        finished = reason is not None
        return RequestOutput(
            request_id=self.request_id,
            new_token_ids=new,
            new_logprobs=logprobs,
            finished=finished,
            finish_reason=reason,
            num_prompt_tokens=self.num_prompt_tokens,
            num_output_tokens=len(out),
            num_resumed_tokens=len(self.resumed),
            num_cached_tokens=self.num_cached_tokens,
            arrival_time=self.arrival_time,
            first_scheduled_time=self.arrival_time,
            first_token_time=self.first_token_time,
            finished_time=now if finished else None,
        )


def open_stream(
    inp: GenerateInput,
    info: ModelInfo,
    *,
    running: bool,
    live: Collection[str],
    engine: str,
    max_num_seqs: int,
    max_waiting: int,
) -> StreamState:
    """What every such adapter checks before handing a request to its engine, and the
    request's bookkeeping. The engine service has validated already; a direct caller
    gets the same answer here instead of an engine that fails on a bad id.

    ``live`` holds the adapter's requests not yet finished (running or waiting in the
    engine): past ``max_num_seqs + max_waiting`` of them a request is refused, as the
    native engine refuses one when its waiting queue is full, so a flood cannot queue
    unbounded work in an engine that would take it all.

    Raises:
        BackendUnavailableError, DuplicateRequestError, QueueFullError, ValueError (see
        ``Backend``).
    """
    if not running:
        raise BackendUnavailableError(f"the {engine} engine is not running")
    if inp.request_id in live:
        raise DuplicateRequestError(
            f"request_id {inp.request_id!r} is already in use by a live request"
        )
    if len(live) >= max_num_seqs + max_waiting:
        raise QueueFullError(
            f"the {engine} engine's waiting queue is full; retry later or on another replica",
            retry_after_ms(len(live) - max_num_seqs, max_num_seqs),
        )
    inp.validate(info)
    if (guided := inp.sampling_params.guided) is not None:
        raise ValueError(f"{guided.field}: the {engine} adapter has no guided decoding")
    return StreamState(
        inp.request_id,
        len(inp.prompt_token_ids),
        inp.sampling_params,
        time.monotonic(),
        list(inp.resumed_output_token_ids),
    )


async def relay(
    state: StreamState,
    chunks: AsyncIterable[Any],
    totals: dict[str, int],
    close: Callable[[bool], Awaitable[None]],
    *,
    cached_tokens: bool = False,
) -> AsyncGenerator[RequestOutput, None]:
    """The generate loop of an adapter: each cumulative chunk of its engine
    (``chunk.outputs[0]`` with ``token_ids``, ``finish_reason`` and maybe ``logprobs``;
    ``chunk.finished``) as a delta, until the request finished here or there.

    ``totals["generation"]`` counts the tokens streamed. ``close(engine_done)`` runs
    last, however the stream ends (finished, cancelled, closed early); ``engine_done``
    False means the engine still runs the request (a stop sequence matched here
    first, or the caller left) and ``close`` must abort it. With ``cached_tokens``
    the chunk's ``num_cached_tokens`` (prompt tokens from the prefix cache) is read.
    """
    engine_done = False  # the engine ended the request itself
    try:
        async for chunk in chunks:
            o = chunk.outputs[0]
            engine_done = bool(chunk.finished)
            out = state.advance(
                o.token_ids,
                o.finish_reason if chunk.finished else None,
                time.monotonic(),
                getattr(o, "logprobs", None),
                getattr(chunk, "num_cached_tokens", None) if cached_tokens else None,
            )
            totals["generation"] += len(out.new_token_ids)
            yield out
            if out.finished:
                break
    finally:
        await close(engine_done)
