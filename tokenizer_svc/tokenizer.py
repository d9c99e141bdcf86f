"""The model's tokenizer: encode text or chat messages, decode ids, stream deltas.

Loads a prepared HF checkpoint directory (tokenizer.json, tokenizer_config.json,
generation_config.json) with the Rust ``tokenizers`` library; no transformers.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from tokenizer_svc.chat_template import ChatTemplate, ChatTemplateError, Message
from tokenizer_svc.detokenizer import ByteTable, IncrementalDetokenizer


class TokenizerInputError(ValueError):
    """Input the caller must fix (maps to INVALID_ARGUMENT)."""


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
    """

    def __init__(self, model_dir: str | Path, max_input_chars: int = 1_000_000) -> None:
        d = Path(model_dir)
        if not (d / "tokenizer.json").exists():
            raise FileNotFoundError(
                f"{d}/tokenizer.json not found; prepare the model with `make model`"
            )
        self.model_dir = d
        self.max_input_chars = max_input_chars
        self.tokenizer = Tokenizer.from_file(str(d / "tokenizer.json"))
        self.tokenizer.no_truncation()
        self.tokenizer.no_padding()
        cfg = json.loads((d / "tokenizer_config.json").read_text())
        gen_path = d / "generation_config.json"
        gen = json.loads(gen_path.read_text()) if gen_path.exists() else {}
        self.special = self._special_tokens(cfg, gen)
        src = cfg.get("chat_template")
        if src is None and (d / "chat_template.jinja").exists():
            src = (d / "chat_template.jinja").read_text()
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

    def render_chat(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> str:
        """Apply the chat template. Raises TokenizerInputError."""
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
            text = self.chat_template.render(messages, add_generation_prompt)
        except ChatTemplateError as e:
            raise TokenizerInputError(str(e)) from e
        self._check_text(text, "rendered chat prompt")
        return text

    def encode_chat(
        self, messages: Sequence[Message], add_generation_prompt: bool = True
    ) -> tuple[list[int], str]:
        """Render then encode. Special tokens come from the template, none are added."""
        text = self.render_chat(messages, add_generation_prompt)
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
