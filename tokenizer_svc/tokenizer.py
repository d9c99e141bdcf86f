"""The model's tokenizer: encode text or chat messages, decode ids, stream deltas.

Loads the tokenizer files of a prepared HF checkpoint directory (tokenizer.json,
tokenizer_config.json, generation_config.json, chat_template.jinja) with the Rust
``tokenizers`` library; no transformers. The same files can arrive as bytes
(``TextTokenizer.from_files``): engines serve their model's files so a gateway
needs no model directory of its own, and ``tokenizer_digest`` names a tokenizer
by its content.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from tokenizer_svc.chat_template import ChatTemplate, ChatTemplateError, Message
from tokenizer_svc.detokenizer import ByteTable, IncrementalDetokenizer


class TokenizerInputError(ValueError):
    """Input the caller must fix (maps to INVALID_ARGUMENT)."""


class TokenizerFilesError(ValueError):
    """Tokenizer files that cannot be loaded (missing, malformed, too large)."""


# What a tokenizer is made of, in a checkpoint directory; the first two must exist.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "chat_template.jinja",
)
REQUIRED_FILES = TOKENIZER_FILES[:2]
MAX_TOKENIZER_BYTES = 64 * 1024 * 1024  # the files together; the largest known are ~20 MB


def read_tokenizer_files(model_dir: str | Path) -> dict[str, bytes]:
    """The tokenizer files of ``model_dir`` by name (the optional ones only if present).

    Raises:
        FileNotFoundError: A required file is missing.
    """
    d = Path(model_dir)
    if not (d / "tokenizer.json").exists():
        raise FileNotFoundError(
            f"{d}/tokenizer.json not found; prepare the model with `make model`"
        )
    return {name: (d / name).read_bytes() for name in TOKENIZER_FILES if (d / name).exists()}


def tokenizer_digest(files: Mapping[str, bytes]) -> str:
    """sha256 (hex) over the files' names, sizes and bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(files):
        data = files[name]
        h.update(f"{name}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()


def _token_content(value: Any) -> str | None:
    if isinstance(value, dict):
        return str(value.get("content"))
    return value if isinstance(value, str) else None


@dataclass(slots=True, frozen=True)
class SpecialTokens:
    bos_token: str | None
    eos_token: str | None
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None


class TextTokenizer:
    """Tokenizer + chat template + byte table of one model directory.

    Args:
        model_dir: a prepared HF checkpoint directory.
        max_input_chars: longer text (or rendered chat) is rejected.

    Attributes:
        model_dir: Where the files came from (None for ``from_files``).
        digest: ``tokenizer_digest`` of the files.
    """

    model_dir: Path | None

    def __init__(self, model_dir: str | Path, max_input_chars: int = 1_000_000) -> None:
        self._load(read_tokenizer_files(model_dir), max_input_chars)
        self.model_dir = Path(model_dir)

    @classmethod
    def from_files(
        cls, files: Mapping[str, bytes], max_input_chars: int = 1_000_000
    ) -> TextTokenizer:
        """A tokenizer from the files' bytes (as ``read_tokenizer_files`` returns them).

        Raises:
            TokenizerFilesError: A required file is missing, one is malformed, or they
                are larger than ``MAX_TOKENIZER_BYTES`` together.
        """
        missing = [n for n in REQUIRED_FILES if n not in files]
        unknown = sorted(set(files) - set(TOKENIZER_FILES))
        size = sum(len(b) for b in files.values())
        if missing or unknown or size > MAX_TOKENIZER_BYTES:
            raise TokenizerFilesError(
                f"tokenizer files: missing {missing}, unexpected {unknown}, {size} bytes "
                f"(at most {MAX_TOKENIZER_BYTES})"
            )
        tok = cls.__new__(cls)
        try:
            tok._load(files, max_input_chars)
        except Exception as e:  # the tokenizers library raises plain Exception
            raise TokenizerFilesError(f"tokenizer files do not load: {e}") from e
        tok.model_dir = None
        return tok

    def _load(self, files: Mapping[str, bytes], max_input_chars: int) -> None:
        self.digest = tokenizer_digest(files)
        self.max_input_chars = max_input_chars
        self.tokenizer = Tokenizer.from_str(files["tokenizer.json"].decode())
        self.tokenizer.no_truncation()
        self.tokenizer.no_padding()
        cfg = json.loads(files["tokenizer_config.json"])
        gen_raw = files.get("generation_config.json")
        gen = json.loads(gen_raw) if gen_raw is not None else {}
        if not isinstance(cfg, dict) or not isinstance(gen, dict):
            raise TokenizerFilesError("tokenizer or generation config is not a JSON object")
        self.special = self._special_tokens(cfg, gen)
        src = cfg.get("chat_template")
        if src is None and "chat_template.jinja" in files:
            src = files["chat_template.jinja"].decode()
        self.chat_template = (
            ChatTemplate(
                src, {"bos_token": self.special.bos_token, "eos_token": self.special.eos_token}
            )
            if src
            else None
        )
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        self.byte_table = ByteTable.build(self.tokenizer)

    def _special_tokens(self, cfg: dict[str, Any], gen: dict[str, Any]) -> SpecialTokens:
        bos, eos = _token_content(cfg.get("bos_token")), _token_content(cfg.get("eos_token"))
        eos_ids = gen.get("eos_token_id")
        if eos_ids is None and eos is not None:
            eos_ids = self.tokenizer.token_to_id(eos)
        ids = (
            tuple(eos_ids)
            if isinstance(eos_ids, list)
            else ((int(eos_ids),) if eos_ids is not None else ())
        )
        bos_id = gen.get("bos_token_id")
        if bos_id is None and bos is not None:
            bos_id = self.tokenizer.token_to_id(bos)
        return SpecialTokens(bos, eos, ids, bos_id)

    def _check_text(self, text: str, what: str = "text") -> None:
        if len(text) > self.max_input_chars:
            raise TokenizerInputError(
                f"{what} is {len(text)} characters; the limit is {self.max_input_chars}: "
                "shorten it or split it into several requests"
            )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Encode plain text. Raises TokenizerInputError on empty or oversized text."""
        if not text:
            raise TokenizerInputError("text is empty: send a non-empty prompt")
        self._check_text(text)
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def encode_batch(
        self, texts: Sequence[str], add_special_tokens: bool = True
    ) -> list[list[int]]:
        """Encode many texts in one call (parallel in Rust)."""
        for i, t in enumerate(texts):
            if not t:
                raise TokenizerInputError(f"texts[{i}] is empty: send non-empty prompts")
            self._check_text(t, f"texts[{i}]")
        encs = self.tokenizer.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        return [list(e.ids) for e in encs]

    def render_chat(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        tools: Sequence[dict[str, Any]] | None = None,
    ) -> str:
        """Apply the chat template (``tools`` for a template that reads them).
        Raises TokenizerInputError."""
        if self.chat_template is None:
            raise TokenizerInputError(
                "this model has no chat template: send a plain prompt instead of messages"
            )
        total = sum(len(m.content) for m in messages)
        if total > self.max_input_chars:
            raise TokenizerInputError(
                f"messages hold {total} characters; the limit is {self.max_input_chars}"
            )
        try:
            text = self.chat_template.render(messages, add_generation_prompt, tools)
        except ChatTemplateError as e:
            raise TokenizerInputError(str(e)) from e
        self._check_text(text, "rendered chat prompt")
        return text

    def encode_chat(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        tools: Sequence[dict[str, Any]] | None = None,
    ) -> tuple[list[int], str]:
        """Render then encode. Special tokens come from the template, none are added."""
        text = self.render_chat(messages, add_generation_prompt, tools)
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids), text

    def check_ids(self, ids: Sequence[int]) -> None:
        """Raise TokenizerInputError if an id is outside the vocabulary."""
        for pos, i in enumerate(ids):
            if not 0 <= i < self.vocab_size:
                raise TokenizerInputError(
                    f"token_ids[{pos}] = {i} is outside the vocabulary "
                    f"(valid ids: 0..{self.vocab_size - 1})"
                )

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        self.check_ids(ids)
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def detokenizer(self, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        """A fresh incremental detokenizer for one stream."""
        return IncrementalDetokenizer(self.tokenizer, self.byte_table, skip_special_tokens)
