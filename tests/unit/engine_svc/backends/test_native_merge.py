"""Coalescing a lagging stream's queued outputs loses and reorders nothing."""

from __future__ import annotations

from functools import reduce

from hypothesis import given
from hypothesis import strategies as st

from engine_svc.backends.native import merge_outputs
from engine_svc.core import FinishReason, RequestOutput, TokenLogprobs


def _lp(token: int) -> TokenLogprobs:
    return TokenLogprobs(token, -0.5, 1, [token], [-0.5])


@given(
    chunks=st.lists(st.lists(st.integers(0, 100), max_size=4), min_size=1, max_size=8),
    with_logprobs=st.booleans(),
)
def test_merged_outputs_carry_every_token_in_order(
    chunks: list[list[int]], with_logprobs: bool
) -> None:
    outs = [
        RequestOutput(
            "r",
            ids,
            new_logprobs=[_lp(t) for t in ids] if with_logprobs else None,
            num_output_tokens=sum(len(c) for c in chunks[: i + 1]),
        )
        for i, ids in enumerate(chunks)
    ]
    outs[-1].finished = True
    outs[-1].finish_reason = FinishReason.LENGTH
    merged = reduce(merge_outputs, outs)
    assert merged.new_token_ids == [t for c in chunks for t in c]
    if with_logprobs:
        assert merged.new_logprobs is not None
        assert [lp.token_id for lp in merged.new_logprobs] == merged.new_token_ids
    else:
        assert merged.new_logprobs is None
    # state is the latest output's: finish, counters
    assert merged.finished
    assert merged.finish_reason == FinishReason.LENGTH
    assert merged.num_output_tokens == sum(len(c) for c in chunks)
