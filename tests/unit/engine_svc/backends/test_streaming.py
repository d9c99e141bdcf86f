"""Stream bookkeeping shared by the adapters of engines that stream cumulative output
(TensorRT-LLM, vLLM): deltas, stop sequences held back and trimmed by the native
engine's rule, resumed tokens of a failed-over stream."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engine_svc.backends.streaming import StreamState
from engine_svc.core.request import FinishReason
from engine_svc.core.sampling_params import SamplingParams


def test_stream_state_holds_back_a_possible_stop_and_trims_a_completed_one() -> None:
    p = SamplingParams(max_tokens=10, stop_sequences=[[7, 8]])
    state = StreamState("r", num_prompt_tokens=3, params=p, arrival_time=0.0)
    a = state.advance([1, 2], None, 1.0)
    assert (a.new_token_ids, a.finished, a.first_token_time) == ([1, 2], False, 1.0)
    b = state.advance([1, 2, 3, 7], None, 2.0)
    assert b.new_token_ids == [3]  # 7 may begin the stop sequence: not sent yet
    c = state.advance([1, 2, 3, 7, 8], None, 3.0)  # it completes: trimmed, STOP
    assert (c.new_token_ids, c.finished, c.finish_reason) == ([], True, FinishReason.STOP)
    assert c.num_output_tokens == 5
    d = StreamState("s", 1, SamplingParams(max_tokens=2), 0.0).advance([4, 5], "length", 1.0)
    assert (d.new_token_ids, d.finish_reason, d.finished_time) == ([4, 5], FinishReason.LENGTH, 1.0)


def _expected(out: list[int], stops: list[list[int]], min_tokens: int) -> tuple[list[int], bool]:
    """What a client should get, by the native engine's rule: the output up to the
    first completed stop sequence (not counted before min_tokens), without it."""
    for n in range(1, len(out) + 1):
        if n < min_tokens:
            continue
        for seq in stops:
            if seq and n >= len(seq) and out[n - len(seq) : n] == seq:
                return out[: n - len(seq)], True
    return out, False


@settings(max_examples=300, deadline=None)
@given(
    out=st.lists(st.integers(0, 3), max_size=14),
    stops=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=3), max_size=2),
    min_tokens=st.integers(0, 4),
    step=st.integers(1, 3),
)
def test_streamed_deltas_never_contain_a_token_of_a_trimmed_stop(
    out: list[int], stops: list[list[int]], min_tokens: int, step: int
) -> None:
    params = SamplingParams(
        max_tokens=max(1, len(out)),
        stop_sequences=stops,
        min_tokens=min(min_tokens, max(1, len(out))),
    )
    state = StreamState("r", 1, params, 0.0)
    sent: list[int] = []
    finished = False
    for n in range(step, len(out) + step, step):  # TensorRT-LLM may add several at once
        last = n >= len(out)
        o = state.advance(out[:n], "length" if last else None, float(n))
        sent += o.new_token_ids
        if o.finished:
            finished = True
            break
    want, stopped = _expected(out, stops, params.min_tokens)
    assert finished == bool(stopped or out)
    assert sent == want  # also when a chunk brings the stop and tokens past it


def test_resumed_tokens_are_not_resent_and_a_stop_may_span_them() -> None:
    p = SamplingParams(max_tokens=6, min_tokens=3, stop_sequences=[[6, 9]])
    state = StreamState("r", 4, p, 0.0, resumed=[5, 6])
    first = state.advance([9], None, 1.0)  # the stop spans the resumed and the new token
    assert (first.new_token_ids, first.finish_reason) == ([], FinishReason.STOP)
    assert (first.num_output_tokens, first.num_resumed_tokens) == (3, 2)
    cont = StreamState("r2", 4, SamplingParams(max_tokens=6), 0.0, resumed=[5, 6])
    assert cont.advance([7, 8], None, 1.0).new_token_ids == [7, 8]
