"""Stop strings over arbitrary splits of the text (hypothesis) and edge cases."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from gateway.request.stop_strings import StopMatcher


def run(stops: list[str], deltas: list[str]) -> tuple[str, bool]:
    m = StopMatcher(stops)
    out = "".join(m.feed(d) for d in deltas)
    if not m.stopped:
        out += m.flush()
    return out, m.stopped


def reference(stops: list[str], text: str) -> tuple[str, bool]:
    """The whole text at once: the stop that completes first (earliest end; of two ending
    together, the longer one) cuts the text where it starts."""
    hits = [(text.find(s) + len(s), text.find(s)) for s in stops if s and s in text]
    return (text[: min(hits)[1]], True) if hits else (text, False)


def test_stop_split_across_deltas_is_trimmed() -> None:
    assert run(["END"], ["the E", "N", "D and more"]) == ("the ", True)
    assert run(["END"], ["the E", "n"]) == ("the En", False)
    assert run(["a", "bc"], ["xb", "c"]) == ("x", True)
    assert run([], ["free"]) == ("free", False)
    # a stop that completes first wins over a longer one that started earlier
    assert run(["a", "!aa"], ["!a", "a"]) == ("!", True)
    assert run(["a", "!aa"], ["!aa"]) == ("!", True)
    assert run(["ab", "b"], ["ab"]) == ("", True)  # both end together: the longer one


def test_after_a_stop_nothing_more_is_emitted() -> None:
    m = StopMatcher(["!"])
    assert m.feed("hi!") == "hi"
    assert m.feed("more") == ""
    assert m.flush() == ""
    assert m.matched == "!"


alphabet = st.sampled_from("abc!é ")


@given(
    stops=st.lists(st.text(alphabet, min_size=1, max_size=4), max_size=3),
    text=st.text(alphabet, max_size=40),
    cuts=st.lists(st.integers(0, 40), max_size=8),
)
def test_any_split_equals_matching_the_whole_text(
    stops: list[str], text: str, cuts: list[int]
) -> None:
    points = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    deltas = [text[a:b] for a, b in itertools.pairwise(points)]
    assert run(stops, deltas) == reference(stops, text)
