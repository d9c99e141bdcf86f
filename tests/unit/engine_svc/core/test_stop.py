"""Stop conditions and streaming hold-back, resumed outputs included."""

from __future__ import annotations

from engine_svc.core.request import Request, RequestStatus
from engine_svc.core.sampling_params import SamplingParams
from engine_svc.core.stop_checker import check_stop, take_new_tokens


def feed(req: Request, tokens: list[int], max_len: int = 100) -> list[list[int]]:
    """Append tokens one by one like the engine; the streamed chunks."""
    chunks = []
    for t in tokens:
        req.append_output_token(t)
        status = check_stop(req, max_len)
        if status is not None:
            req.status = status
        start, end = take_new_tokens(req)
        chunks.append(req.output_token_ids[start:end])
        if req.is_finished:
            break
    return chunks


def mk(resumed: list[int] | None = None, **kw: object) -> Request:
    params = SamplingParams(**({"max_tokens": 10} | kw))  # type: ignore[arg-type]
    return Request.create(
        "r", [50, 51], params, 0.0, resumed_output_token_ids=resumed, eos_token_ids=(2,)
    )


def test_eos_stops_and_is_withheld_unless_asked() -> None:
    req = mk()
    assert feed(req, [5, 6, 2, 7]) == [[5], [6], []]
    assert req.status == RequestStatus.FINISHED_STOPPED
    assert req.stop_token_id == 2
    req = mk(include_stop_in_output=True)
    assert feed(req, [5, 2]) == [[5], [2]]


def test_ignore_eos_and_min_tokens() -> None:
    req = mk(ignore_eos=True, max_tokens=3)
    assert feed(req, [2, 2, 2]) == [[2], [2], [2]]
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED
    req = mk(min_tokens=2, stop_token_ids=[9])
    assert feed(req, [9, 9]) == [[9], []]
    assert req.stop_token_id == 9


def test_stop_sequence_holds_back_a_possible_match() -> None:
    req = mk(stop_sequences=[[7, 8, 9]])
    assert feed(req, [5, 7, 8, 4, 7, 8, 9]) == [[5], [], [], [7, 8, 4], [], [], []]
    assert req.status == RequestStatus.FINISHED_STOPPED
    assert req.stop_token_id is None
    req = mk(stop_sequences=[[7, 8]], include_stop_in_output=True)
    assert feed(req, [7, 8]) == [[], [7, 8]]


def test_held_back_tokens_are_released_at_length() -> None:
    req = mk(stop_sequences=[[7, 8]], max_tokens=3)
    assert feed(req, [1, 3, 7]) == [[1], [3], [7]]
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_resumed_tokens_count_as_output_and_are_not_streamed() -> None:
    req = mk(resumed=[4, 7], max_tokens=4, stop_sequences=[[7, 8]])
    assert req.num_tokens == 4
    assert req.num_output_tokens == 2
    assert feed(req, [8]) == [[]]  # completes a stop begun before the failover
    assert req.status == RequestStatus.FINISHED_STOPPED
    req = mk(resumed=[4, 4, 4], max_tokens=4)
    assert feed(req, [5]) == [[5]]
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_context_full_is_length() -> None:
    req = mk(max_tokens=10)
    feed(req, [3, 3], max_len=4)
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert req.num_tokens == 4
