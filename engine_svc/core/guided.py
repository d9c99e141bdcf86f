"""Guided (constrained) decoding with llguidance: constraints, their compilation, and
one matcher per request.

    GuidedSpec (kind, text)  --GuidedCompiler.matcher-->  GuidedMatcher (per request)
       json_schema, json_object,   compiled once per (kind, text), kept in an LRU
       regex, grammar (GBNF),      bounded in entries; each request gets a copy
       choice, lark_grammar,       of the compiled matcher (microseconds)
       structural_tag

A request's matcher is advanced on every token it accepts (resumed tokens of a
failed-over stream included); ``guided_mask`` turns the live matchers of a step
into a mask over the logits. The tokenizer llguidance needs comes from the model
directory's ``tokenizer.json`` (read by llguidance itself: no transformers).
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llguidance

logger = logging.getLogger(__name__)

# the GuidedDecoding oneof of llm.v1 (protos/llm/v1/common.proto), in field order
KINDS = (
    "json_schema",
    "json_object",
    "regex",
    "grammar",
    "choice",
    "lark_grammar",
    "structural_tag",
)
_ANY_OBJECT = '{"type": "object"}'
DEFAULT_CACHE_ENTRIES = 256


@dataclass(frozen=True, slots=True)
class GuidedSpec:
    """One constraint on a request's output.

    Attributes:
        kind: one of ``KINDS`` (the name of the llm.v1 GuidedDecoding field).
        text: the constraint: a JSON schema, a regex, a GBNF or Lark grammar, a
            structural tag (JSON); for ``choice`` a JSON list of the strings; empty
            for ``json_object``.
    """

    kind: str
    text: str = ""

    @classmethod
    def choice(cls, options: Sequence[str]) -> GuidedSpec:
        """Exactly one of ``options``."""
        return cls("choice", json.dumps(list(options)))

    @property
    def field(self) -> str:
        """The request field that carries it (for error messages)."""
        return f"guided.{self.kind}"

    def validate(self) -> None:
        """Shape checks that need no compilation.

        Raises:
            ValueError: an unknown kind, or an empty constraint; the message names it.
        """
        if self.kind not in KINDS:
            raise ValueError(f"guided: unknown constraint {self.kind!r}; one of {', '.join(KINDS)}")
        if self.kind == "json_object":
            return
        if not self.text.strip():
            raise ValueError(f"{self.field} is empty")
        if self.kind == "choice":
            options = json.loads(self.text)
            if not options or not all(isinstance(o, str) and o for o in options):
                raise ValueError(f"{self.field}: give one or more non-empty strings")


def _structural_tag(text: str, special: frozenset[str]) -> str:
    """vLLM's structural tag (``{"structures": [{"begin", "schema", "end"}], "triggers"}``)
    as a llguidance grammar."""
    try:
        tag = json.loads(text)
        structures, triggers = tag["structures"], tag["triggers"]
        tags = []
        for s in structures:
            trig = next((t for t in triggers if s["begin"].startswith(t)), None)
            if trig is None:
                raise ValueError(f"begin {s['begin']!r} starts with none of the triggers")
            schema = s.get("schema", {})
            grammar = schema if isinstance(schema, str) else json.dumps(schema)
            tags.append(
                llguidance.StructTag(trigger=trig, begin=s["begin"], grammar=grammar, end=s["end"])
            )
    except (ValueError, KeyError, TypeError, AssertionError) as e:
        raise ValueError(
            'guided.structural_tag: expected {"structures": [{"begin": ..., "schema": ..., '
            f'"end": ...}}], "triggers": [...]}} with each begin starting with a trigger: {e}'
        ) from None
    angled = {t.trigger for t in tags if t.trigger.startswith("<") and t.trigger.endswith(">")}
    return llguidance.StructTag.to_grammar(tags, assume_special=angled <= special)


def grammar_of(spec: GuidedSpec, special_tokens: frozenset[str] = frozenset()) -> str:
    """The llguidance grammar of a constraint (not compiled yet).

    Raises:
        ValueError: the constraint cannot be read (the message names the field).
    """
    spec.validate()
    try:
        if spec.kind == "json_schema":
            try:
                json.loads(spec.text)
            except ValueError as e:
                raise ValueError(f"not valid JSON: {e}") from None
            return llguidance.grammar_from("json_schema", spec.text)
        if spec.kind == "json_object":
            return llguidance.grammar_from("json_schema", _ANY_OBJECT)
        if spec.kind == "regex":
            return llguidance.grammar_from("regex", spec.text)
        if spec.kind == "grammar":
            try:
                lark = llguidance.gbnf_to_lark.any_to_lark(spec.text)
            except Exception as e:  # the converter raises bare Exceptions
                raise ValueError(f"not a GBNF grammar: {e}") from None
            return llguidance.grammar_from("lark", lark)
        if spec.kind == "choice":
            return llguidance.grammar_from("choice", spec.text)
        if spec.kind == "lark_grammar":
            return llguidance.grammar_from("lark", spec.text)
    except (ValueError, TypeError, KeyError, AssertionError) as e:
        raise ValueError(f"{spec.field}: {e}") from None
    return _structural_tag(spec.text, special_tokens)


class GuidedMatcher:
    """A request's position in its constraint (one llguidance matcher)."""

    __slots__ = ("failed", "matcher")

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher
        self.failed = ""  # why the matcher rejected a token ("" = it never did)

    @property
    def done(self) -> bool:
        """The constraint is complete and allows nothing more (not even text)."""
        return self.matcher.is_stopped()

    @property
    def accepting(self) -> bool:
        """The output so far is a complete match (EOS is allowed)."""
        return self.matcher.is_accepting()

    def advance(self, token_id: int) -> bool:
        """Feed one accepted token; False (and ``failed`` set) when the constraint
        rejects it. A token after the constraint completed (its EOS) is not fed."""
        if self.failed:
            return False
        if self.matcher.is_stopped():
            return True
        if not self.matcher.consume_token(token_id):
            self.failed = self.matcher.get_error() or f"token {token_id} is not allowed here"
            return False
        return True

    def resume(self, token_ids: Sequence[int]) -> None:
        """Feed the resumed output of a failed-over stream.

        Raises:
            ValueError: those tokens do not fit the constraint.
        """
        for i, tok in enumerate(token_ids):
            if not self.advance(tok):
                raise ValueError(
                    f"resumed_output_token_ids: token {i} ({tok}) does not fit the guided "
                    f"constraint: {self.failed}"
                )


class GuidedCompiler:
    """Compiles constraints for one model's tokenizer, with an LRU of compiled ones.

    Thread-safe: the engine service compiles on its own threads (off the step loop)
    while the step thread copies cached ones. Requests for a constraint that is being
    compiled wait for that compile and copy it (one compile per constraint, and one
    compiled grammar whose lazily built lexer every copy shares). The tokenizer is read
    on first use, or ahead of it by ``preload``.

    Args:
        tokenizer_json: the model directory's ``tokenizer.json``.
        vocab_size: the logits' width (the mask's).
        eos_token_ids: the model's EOS ids: allowed where the constraint is complete.
        max_entries: compiled constraints kept (least recently used dropped first).
    """

    def __init__(
        self,
        tokenizer_json: Path,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        max_entries: int = DEFAULT_CACHE_ENTRIES,
    ) -> None:
        if max_entries < 1:
            raise ValueError(f"guided_cache_entries must be >= 1, got {max_entries}")
        self.tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.max_entries = max_entries
        self._lock = threading.Lock()
        self._tok_lock = threading.Lock()
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._special: frozenset[str] = frozenset()
        self._cache: OrderedDict[GuidedSpec, llguidance.LLMatcher] = OrderedDict()
        self._compiling: dict[GuidedSpec, threading.Lock] = {}  # held while one compiles
        self.hits = 0
        self.misses = 0

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the model's tokenizer (built on first use, ~0.5 s)."""
        with self._tok_lock:
            if self._tokenizer is None:
                if not self.tokenizer_json.is_file():
                    raise ValueError(
                        f"guided decoding needs the model's tokenizer.json, which "
                        f"{self.tokenizer_json.parent} lacks"
                    )
                text = self.tokenizer_json.read_text()
                self._special = _special_tokens(json.loads(text))
                self._tokenizer = llguidance.LLTokenizer(
                    text, n_vocab=self.vocab_size, eos_token=self.eos_token_ids
                )
            return self._tokenizer

    @property
    def tokenizer_loaded(self) -> bool:
        """Whether the tokenizer is built (``preload`` or a first guided request)."""
        return self._tokenizer is not None

    def preload(self) -> None:
        """Build the tokenizer now (the engine's start) rather than on the first guided
        request, which would wait for it: ~0.35 s for a 49k vocabulary, holding the GIL.
        A model without a usable tokenizer.json is left to fail on its first guided
        request, as before."""
        try:
            _ = self.tokenizer
        except Exception:  # raised again, and reported, to the first request needing it
            logger.debug("guided decoding's tokenizer not preloaded", exc_info=True)

    def cached(self, spec: GuidedSpec) -> GuidedMatcher | None:
        """A fresh matcher of an already compiled constraint, else None (no compiling)."""
        with self._lock:
            compiled = self._cache.get(spec)
            if compiled is None:
                return None
            self._cache.move_to_end(spec)
            self.hits += 1
            return GuidedMatcher(compiled.deep_copy())

    def matcher(self, spec: GuidedSpec) -> GuidedMatcher:
        """A fresh matcher for ``spec``, compiling it unless cached.

        Raises:
            ValueError: the constraint is malformed (the message names the field and
                the problem), or the model has no tokenizer.json.
        """
        hit = self.cached(spec)
        if hit is not None:
            return hit
        with self._lock:
            gate = self._compiling.setdefault(spec, threading.Lock())
        with gate:  # concurrent requests for one constraint: one compiles, the rest copy
            try:
                hit = self.cached(spec)
                if hit is not None:
                    return hit
                compiled = self._compile(spec)
                with self._lock:
                    self.misses += 1
                    self._cache[spec] = compiled
                    self._cache.move_to_end(spec)
                    while len(self._cache) > self.max_entries:
                        self._cache.popitem(last=False)
                    return GuidedMatcher(compiled.deep_copy())
            finally:
                with self._lock:
                    self._compiling.pop(spec, None)

    def _compile(self, spec: GuidedSpec) -> llguidance.LLMatcher:
        tokenizer = self.tokenizer
        grammar = grammar_of(spec, self._special)
        compiled = llguidance.LLMatcher(tokenizer, grammar, log_level=0)  # drops the GIL
        if compiled.is_error():
            raise ValueError(f"{spec.field}: {compiled.get_error().strip()}")
        return compiled

    def __len__(self) -> int:
        with self._lock:
            return len(self._cache)


def _special_tokens(tokenizer: dict[str, Any]) -> frozenset[str]:
    return frozenset(
        t["content"] for t in tokenizer.get("added_tokens", []) if t.get("special", False)
    )
