"""The fairness experiments' timelines: per-tenant TTFT over time and service share."""

from __future__ import annotations

import pytest

from bench.loadlib.fairness import timelines
from bench.loadlib.targets import RequestRecord


def record(
    tenant: str, start: float, ttft: float | None, e2e: float, prompt: int, out: int
) -> RequestRecord:
    r = RequestRecord(tenant, 2, "chat", start, out)
    r.ttft, r.e2e, r.num_prompt_tokens, r.num_output_tokens = ttft, e2e, prompt, out
    return r


def test_service_is_counted_as_the_engines_count_it_and_shares_sum_to_one() -> None:
    recs = [
        # prompt 10 at t=0.5; output tokens at 0.5, 1.0, 1.5 (2 each)
        record("a", 0.0, 0.5, 1.5, 10, 3),
        # prompt 4 and its one output token at t=1.2
        record("b", 1.0, 0.2, 0.2, 4, 1),
        record("b", 1.5, None, 0.1, 4, 0),  # failed before a token: no service
    ]
    tl = timelines(recs, bin_s=1.0)
    assert tl["bins"] == [0.0, 1.0]
    assert tl["share"]["a"] == pytest.approx([1.0, 0.4])  # bin 1: a 4, b 6
    assert tl["share"]["b"] == pytest.approx([0.0, 0.6])
    assert tl["ttft_ms"] == {"a": [[0.0, 500.0]], "b": [[1.0, 200.0]]}


def test_no_records_no_bins() -> None:
    assert timelines([])["bins"] == []
