"""The <think> splitter: thought and answer apart, whatever the split of the text."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from gateway.request.reasoning import ThinkSplitter


def run(deltas: list[str]) -> tuple[str, str]:
    s = ThinkSplitter()
    parts = [s.feed(d) for d in deltas] + [s.finish()]
    return "".join(r for r, _ in parts), "".join(c for _, c in parts)


def test_the_thought_goes_apart_from_the_answer() -> None:
    text = "<think>two and two</think>It is 4. <thin"
    assert run([text]) == ("two and two", "It is 4. <thin")
    for cut in range(len(text) + 1):
        assert run([text[:cut], text[cut:]]) == ("two and two", "It is 4. <thin"), cut
    assert run(["no thought"]) == ("", "no thought")
    assert run(["<think>cut short"]) == ("cut short", "")


@given(
    thought=st.text("ab <>/", max_size=10).filter(lambda s: "</think>" not in s),
    answer=st.text("ab <>/", max_size=10).filter(lambda s: "<think>" not in s),
    cuts=st.lists(st.integers(0, 60), max_size=8),
)
def test_any_split_gives_the_same_parts(thought: str, answer: str, cuts: list[int]) -> None:
    text = f"<think>{thought}</think>{answer}"
    points = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    assert run([text[a:b] for a, b in itertools.pairwise(points)]) == (thought, answer)
