"""Incremental detokenization: deltas concatenate to the full decode for every split."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models

from tokenizer_svc.detokenizer import ByteTable, IncrementalDetokenizer
from tokenizer_svc.tokenizer import TextTokenizer

SUPPRESS = [HealthCheck.function_scoped_fixture]


def stream(detok: IncrementalDetokenizer, ids: list[int], cuts: list[int]) -> list[str]:
    bounds = sorted({c % (len(ids) + 1) for c in cuts} | {0, len(ids)})
    parts = [detok.add(ids[a:b]) for a, b in itertools.pairwise(bounds)]
    return [*parts, detok.finish()]


def test_never_emits_half_a_character(tok: TextTokenizer) -> None:
    ids = tok.encode("你好🎉")
    detok = tok.detokenizer()
    deltas = [detok.add([i]) for i in ids] + [detok.finish()]
    assert "".join(deltas) == "你好🎉"
    assert all("\ufffd" not in d for d in deltas)


def test_corpus_token_by_token(tok: TextTokenizer, corpus: list[str]) -> None:
    for text in corpus:
        ids = tok.encode(text)
        detok = tok.detokenizer(skip_special_tokens=False)
        assert "".join(detok.add([i]) for i in ids) + detok.finish() == text


@settings(max_examples=300, deadline=None, suppress_health_check=SUPPRESS)
@given(
    ids=st.lists(st.integers(0, 49151), max_size=40),
    cuts=st.lists(st.integers(0, 64), max_size=10),
    skip=st.booleans(),
)
def test_any_ids_any_split_equals_full_decode(
    tok: TextTokenizer, ids: list[int], cuts: list[int], skip: bool
) -> None:
    """Random ids include byte tokens that form invalid UTF-8: still identical."""
    detok = tok.detokenizer(skip_special_tokens=skip)
    assert "".join(stream(detok, ids, cuts)) == tok.tokenizer.decode(ids, skip_special_tokens=skip)


@settings(max_examples=200, deadline=None, suppress_health_check=SUPPRESS)
@given(text=st.text(max_size=60), cuts=st.lists(st.integers(0, 64), max_size=8))
def test_any_text_round_trips_through_any_split(
    tok: TextTokenizer, text: str, cuts: list[int]
) -> None:
    ids = tok.tokenizer.encode(text, add_special_tokens=False).ids
    deltas = stream(tok.detokenizer(), ids, cuts)
    full = tok.tokenizer.decode(ids)
    assert "".join(deltas) == full
    if "\ufffd" not in full:  # a delta never carries half a character
        assert all("\ufffd" not in d for d in deltas)


def test_out_of_vocabulary_id_is_rejected(tok: TextTokenizer) -> None:
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.detokenizer().add([10**6])


@pytest.fixture(scope="module")
def sentencepiece_tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """A Llama-2-style tokenizer: '▁' word starts, <0xNN> byte fallback, strip one space."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in ["▁", "▁Hello", "▁world", "lo", "▁caf", "é", "▁你", "好", "!"]:
        vocab[piece] = len(vocab)
    t = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    t.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    t.add_special_tokens(["<s>", "</s>"])
    path: Path = tmp_path_factory.mktemp("sp") / "tokenizer.json"
    t.save(str(path))
    return Tokenizer.from_file(str(path))


def test_sentencepiece_table_is_recognised(sentencepiece_tok: Tokenizer) -> None:
    table = ByteTable.build(sentencepiece_tok)
    assert table.kind == "sentencepiece"
    assert table.strip_leading_space
    assert table.token_bytes[3 + 0xE4] == b"\xe4"  # <0xE4> is one raw byte
    decoder = json.loads(sentencepiece_tok.to_str())["decoder"]
    assert decoder["type"] == "Sequence"


SP_PIECES = [259, 260, 261, 262, 263, 264, 265, 266, 267, 1, 2]  # words and specials
# no lone surrogates (not encodable as UTF-8, so no token spells them) and no U+FFFD
NO_FFFD = st.characters(exclude_characters="\ufffd", exclude_categories=["Cs"])


@settings(max_examples=300, deadline=None)
@given(
    parts=st.lists(
        # U+FFFD itself would make "no replacement character" untestable
        st.one_of(st.sampled_from(SP_PIECES), st.text(NO_FFFD, min_size=1, max_size=3)),
        max_size=12,
    ),
    cuts=st.lists(st.integers(0, 40), max_size=8),
    skip=st.booleans(),
)
def test_sentencepiece_byte_fallback_any_split(
    sentencepiece_tok: Tokenizer, parts: list[int | str], cuts: list[int], skip: bool
) -> None:
    """Words, specials and characters spelled as <0xNN> byte tokens, split anywhere."""
    ids: list[int] = []
    for p in parts:
        ids += [p] if isinstance(p, int) else [3 + b for b in p.encode("utf-8")]
    detok = IncrementalDetokenizer(sentencepiece_tok, ByteTable.build(sentencepiece_tok), skip)
    deltas = stream(detok, ids, cuts)
    assert "".join(deltas) == sentencepiece_tok.decode(ids, skip_special_tokens=skip)
    assert all("\ufffd" not in d for d in deltas)


def test_sentencepiece_invalid_byte_run_replaces_only_bad_bytes(
    sentencepiece_tok: Tokenizer,
) -> None:
    """Documented difference: HF's ByteFallback turns a whole invalid run of byte
    tokens into one U+FFFD per byte, retroactively; streaming cannot take back text
    it already sent, so we replace only the invalid bytes (Unicode's practice)."""
    ids = [3 + 0x41, 3 + 0x80]  # "A" then a stray continuation byte
    detok = IncrementalDetokenizer(sentencepiece_tok, ByteTable.build(sentencepiece_tok), True)
    assert "".join(stream(detok, ids, [1])) == "A\ufffd"
    assert sentencepiece_tok.decode(ids) == "\ufffd\ufffd"
