"""Incremental detokenization: token ids in, UTF-8 safe text deltas out.

Every token maps to a fixed byte string (the "byte table"), built once from
the tokenizer's decoder:

    ByteLevel (GPT-2 style)      "Ġhello" -> b" hello"   (byte alphabet inverted)
    SentencePiece byte fallback  "▁hello" -> b" hello",  "<0xE4>" -> b"\\xe4"
                                 and one leading space of the text is dropped

A stream then is bytes appended to an incremental UTF-8 decoder, which
holds back an incomplete multi-byte character until its last byte arrives
(so a delta never ends in half a character) and replaces invalid bytes
exactly as a full decode does. The concatenated deltas (after ``finish``)
therefore equal ``tokenizer.decode(all_ids)`` for every way of splitting the
ids into chunks. One documented exception: where SentencePiece byte-fallback
tokens form *invalid* UTF-8, HF replaces the whole run of byte tokens with one
U+FFFD per byte, retroactively; a stream cannot take back text it already
sent, so here only the invalid bytes are replaced. Tokenizers with other
decoders fall back to a slower prefix-diff algorithm on ``tokenizer.decode``.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from tokenizers import Tokenizer


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character alphabet."""
    bs = list(range(ord("!"), ord("~") + 1))
    bs += list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


_BYTE_DECODER = {c: b for b, c in _bytes_to_unicode().items()}


def _byte_level_bytes(token: str) -> bytes:
    return b"".join(
        bytes([_BYTE_DECODER[ch]]) if ch in _BYTE_DECODER else ch.encode("utf-8") for ch in token
    )


def _sentencepiece_bytes(token: str) -> bytes:
    if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
        try:
            return bytes([int(token[3:5], 16)])
        except ValueError:
            pass
    return token.replace("▁", " ").encode("utf-8")


def _decoder_kind(decoder: dict[str, Any] | None) -> tuple[str, bool]:
    """(kind, strip_leading_space) for the decoders we can map to bytes exactly."""
    if not decoder:
        return "unknown", False
    if decoder.get("type") == "ByteLevel":
        return "byte_level", False
    if decoder.get("type") == "Sequence":
        types = [d.get("type") for d in decoder.get("decoders", [])]
        if "ByteFallback" in types and set(types) <= {"Replace", "ByteFallback", "Fuse", "Strip"}:
            strip = any(
                d.get("type") == "Strip" and d.get("content") == " " and d.get("start") == 1
                for d in decoder["decoders"]
            )
            return "sentencepiece", strip
    if decoder.get("type") == "Metaspace":
        return "sentencepiece", decoder.get("prepend_scheme", "always") != "never"
    return "unknown", False


@dataclass(slots=True, frozen=True)
class ByteTable:
    """Per-token byte strings for one tokenizer (special tokens kept and skipped)."""

    kind: str
    strip_leading_space: bool
    token_bytes: tuple[bytes, ...]
    special_ids: frozenset[int]

    @classmethod
    def build(cls, tokenizer: Tokenizer) -> ByteTable:
        decoder = json.loads(tokenizer.to_str()).get("decoder")
        kind, strip = _decoder_kind(decoder)
        vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        specials = frozenset(
            i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special
        )
        to_bytes = _byte_level_bytes if kind == "byte_level" else _sentencepiece_bytes
        table: list[bytes] = []
        for i in range(vocab_size):
            tok = tokenizer.id_to_token(i)
            table.append(b"" if tok is None or kind == "unknown" else to_bytes(tok))
        return cls(kind, strip, tuple(table), specials)


class IncrementalDetokenizer:
    """One stream of ids -> text deltas. Not thread-safe; one per request.

    Example:
        detok = IncrementalDetokenizer(tokenizer, table)
        for ids in chunks:
            send(detok.add(ids))     # may be "" while a character is incomplete
        send(detok.finish())         # flush whatever was held back
    """

    def __init__(
        self, tokenizer: Tokenizer, table: ByteTable, skip_special_tokens: bool = True
    ) -> None:
        self._tok = tokenizer
        self._table = table
        self._skip = skip_special_tokens
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._at_start = True
        self._ids: list[int] = []
        self._emitted = 0  # fallback path: chars of the full decode already sent
        self.num_tokens = 0

    def _check(self, ids: Sequence[int]) -> None:
        n = len(self._table.token_bytes)
        for i in ids:
            if not 0 <= i < n:
                raise ValueError(f"token id {i} is outside the vocabulary (0..{n - 1})")

    def add(self, ids: Iterable[int]) -> str:
        """Append ids; return the text that is now complete."""
        ids = list(ids)
        self._check(ids)
        self.num_tokens += len(ids)
        if self._table.kind == "unknown":
            return self._add_fallback(ids)
        tb, specials = self._table.token_bytes, self._table.special_ids
        data = b"".join(tb[i] for i in ids if not (self._skip and i in specials))
        if self._at_start and data:
            self._at_start = False
            if self._table.strip_leading_space and data.startswith(b" "):
                data = data[1:]
        return self._decoder.decode(data, final=False)

    def finish(self) -> str:
        """Flush: an incomplete trailing character becomes U+FFFD, as in a full decode."""
        if self._table.kind == "unknown":
            text = self._tok.decode(self._ids, skip_special_tokens=self._skip)
            return text[self._emitted :]
        return self._decoder.decode(b"", final=True)

    def _add_fallback(self, ids: list[int]) -> str:
        # O(n) per call; only for decoders the byte table cannot express.
        self._ids.extend(ids)
        text = self._tok.decode(self._ids, skip_special_tokens=self._skip)
        if text.endswith("\ufffd"):
            return ""  # maybe half a character: wait for more
        delta = text[self._emitted :]
        self._emitted = len(text)
        return delta
