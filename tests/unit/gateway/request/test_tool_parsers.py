"""Tool-call parsers: each family's format, text that only looks like a call, and the
same result however the reply is split into deltas (every 2-way split, hypothesis)."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.request.tool_parsers import PARSERS, Call, parser_for_template


def run(parser: str, deltas: list[str]) -> tuple[str, list[Call]]:
    p = PARSERS[parser]()
    content, calls = [], []
    for d in deltas:
        c, found = p.feed(d)
        content.append(c)
        calls.extend(found)
    c, found = p.finish()
    return "".join(content) + c, calls + found


HERMES = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    '</tool_call>\n<tool_call>{"name": "now", "arguments": {}}</tool_call>\n'
)
CASES: list[tuple[str, str, tuple[str, list[Call]]]] = [
    ("hermes", HERMES, ("Let me check.", [("get_weather", '{"city": "Paris"}'), ("now", "{}")])),
    ("hermes", "plain answer, no call", ("plain answer, no call", [])),
    ("hermes", "a < b and <tool c", ("a < b and <tool c", [])),
    (
        "hermes",
        "x <tool_call>{not json</tool_call> y",
        ("x <tool_call>{not json</tool_call> y", []),
    ),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": [1]}}', ("", [("f", '{"a": [1]}')])),
    ("hermes", "<tool_call>{unfinished", ("<tool_call>{unfinished", [])),
    (
        "llama3_json",
        ' {"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}',
        ("", [("f", '{"a": 1}'), ("g", "{}")]),
    ),
    ("llama3_json", "Hello {there}", ("Hello {there}", [])),
    ("llama3_json", '{"answer": 42}', ('{"answer": 42}', [])),
    ("llama3_json", '{"name": "f", "parameters": {"a"', ('{"name": "f", "parameters": {"a"', [])),
    (
        "mistral",
        '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": "{}"}]',
        ("", [("f", '{"a": 1}'), ("g", "{}")]),
    ),
    ("mistral", "[TOOL_CALLS] nope", ("[TOOL_CALLS]nope", [])),
    ("mistral", "[TOOL] is a word", ("[TOOL] is a word", [])),
    ("mistral", '[{"name": "f", "arguments": {}}]', ("", [("f", "{}")])),  # marker skipped
    ("mistral", "[{1: 2}] is not a call", ("[{1: 2}] is not a call", [])),
    ("mistral", '[{"a": 1}]', ('[{"a": 1}]', [])),
]


@pytest.mark.parametrize(("parser", "text", "expected"), CASES)
def test_every_two_way_split_gives_the_whole_texts_result(
    parser: str, text: str, expected: tuple[str, list[Call]]
) -> None:
    assert run(parser, [text]) == expected
    for cut in range(len(text) + 1):
        assert run(parser, [text[:cut], text[cut:]]) == expected, cut


def test_calls_come_out_as_soon_as_they_close() -> None:
    p = PARSERS["hermes"]()
    assert p.feed('<tool_call>{"name": "f", "arguments": {}}</tool_call>') == ("", [("f", "{}")])
    assert p.feed("<tool_ca") == ("", [])
    p = PARSERS["llama3_json"]()
    assert p.feed('{"name": "f", "parameters": {}}; {"na') == ("", [("f", "{}")])


def test_the_template_picks_the_parser() -> None:
    assert parser_for_template("{{ '[TOOL_CALLS]' }}") == "mistral"
    assert parser_for_template("{{ '<|python_tag|>' }}") == "llama3_json"
    assert parser_for_template("{% for m in messages %}{% endfor %}") == "hermes"


names = st.from_regex(r"[a-z_]{1,8}", fullmatch=True)
json_args = st.dictionaries(
    st.text("abxyz", min_size=1, max_size=4),
    st.one_of(st.integers(-5, 5), st.text("ab <>{}[]\"'\\é", max_size=6), st.booleans()),
    max_size=3,
)
prose = st.text("ab <>.{}\n", max_size=12).filter(lambda s: s.strip() == s and "<tool" not in s)


def render(parser: str, calls: list[tuple[str, dict[str, Any]]], before: str) -> str:
    if parser == "hermes":
        blocks = "\n".join(
            f"<tool_call>\n{json.dumps({'name': n, 'arguments': a})}\n</tool_call>"
            for n, a in calls
        )
        return f"{before}\n{blocks}\n"
    if parser == "llama3_json":
        return "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in calls)
    return "[TOOL_CALLS]" + json.dumps([{"name": n, "arguments": a} for n, a in calls])


@settings(max_examples=60, deadline=None)
@given(
    parser=st.sampled_from(sorted(PARSERS)),
    calls=st.lists(st.tuples(names, json_args), min_size=1, max_size=3),
    before=prose,
    cuts=st.lists(st.integers(0, 400), max_size=12),
)
def test_rendered_calls_parse_back_under_any_split(
    parser: str, calls: list[tuple[str, dict[str, Any]]], before: str, cuts: list[int]
) -> None:
    text = render(parser, calls, before)
    points = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    content, found = run(parser, [text[a:b] for a, b in itertools.pairwise(points)])
    assert [(n, json.loads(a)) for n, a in found] == calls
    assert content == (before if parser == "hermes" else "")
