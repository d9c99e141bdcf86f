"""Stop conditions and the hold-back of tokens that may begin a stop sequence."""

from __future__ import annotations

from engine_svc.core.request import Request, RequestStatus


def stop_match(out: list[int], stop_sequences: list[list[int]], end: int | None = None) -> int:
    """Length of the stop sequence ``out[:end]`` ends with (the first listed that
    matches), 0 if none; compares only the window (a slice of the sequence's length).
    Shared by every backend that matches stop sequences itself."""
    end = len(out) if end is None else end
    for seq in stop_sequences:
        n = len(seq)
        if n and end >= n and out[end - n : end] == seq:
            return n
    return 0


def stop_holdback(out: list[int], stop_sequences: list[list[int]]) -> int:
    """Longest suffix of ``out`` that is a proper prefix of some stop sequence: tokens
    that must not be streamed yet, since the next ones may complete the stop."""
    best = 0
    for seq in stop_sequences:
        for n in range(min(len(seq) - 1, len(out)), best, -1):
            if out[-n:] == seq[:n]:
                best = n
                break
    return best


def check_stop(request: Request, max_model_len: int) -> RequestStatus | None:
    """Decide whether the last appended token ends ``request``.

    Order: a guided request's constraint (rejected the token: error; complete
    and allowing nothing more: stop, whatever min_tokens says), min_tokens gate,
    EOS (unless ignore_eos), stop token ids, stop sequences over the whole output
    (resumed tokens included), then length (max_tokens, or the context is full).
    Sets ``stop_token_id`` and ``num_stop_tokens`` on a stop.

    Returns:
        The finished status, or None to keep going.
    """
    params = request.sampling_params
    out = request.output_token_ids
    guided = request.guided
    if guided is not None and out:
        if guided.failed:
            return RequestStatus.FINISHED_ERROR
        if guided.done:
            last = out[-1]
            if last in request.eos_token_ids or last in params.stop_token_ids:
                request.stop_token_id = last
                request.num_stop_tokens = 1
            return RequestStatus.FINISHED_STOPPED
    if len(out) >= params.min_tokens and out:
        last = out[-1]
        if (not params.ignore_eos and last in request.eos_token_ids) or (
            last in params.stop_token_ids
        ):
            request.stop_token_id = last
            request.num_stop_tokens = 1
            return RequestStatus.FINISHED_STOPPED
        matched = stop_match(out, params.stop_sequences)
        if matched:
            request.num_stop_tokens = matched
            return RequestStatus.FINISHED_STOPPED
    if len(out) >= params.max_tokens or request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH_CAPPED
    return None


def take_new_tokens(request: Request) -> tuple[int, int]:
    """The output range ``[start, end)`` that may be streamed now; advances ``num_streamed``.

    While running, tokens that could still turn into a stop sequence are held
    back. Once finished, everything but a withheld stop match is released.
    """
    n = len(request.output_token_ids)
    if request.is_finished:
        keep = request.sampling_params.include_stop_in_output
        end = n if keep else n - request.num_stop_tokens
    else:
        end = n - stop_holdback(request.output_token_ids, request.sampling_params.stop_sequences)
    start = request.num_streamed
    end = max(end, start)
    request.num_streamed = end
    return start, end
