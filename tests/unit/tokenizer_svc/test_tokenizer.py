"""TextTokenizer against the transformers reference on a multilingual corpus."""

from __future__ import annotations

from typing import Any

import pytest

from tokenizer_svc.chat_template import Message
from tokenizer_svc.tokenizer import TextTokenizer, TokenizerInputError


def test_encode_matches_reference(tok: TextTokenizer, hf_tok: Any, corpus: list[str]) -> None:
    for text in corpus:
        assert tok.encode(text) == hf_tok.encode(text), text


def test_encode_batch_matches_single(tok: TextTokenizer, corpus: list[str]) -> None:
    assert tok.encode_batch(corpus) == [tok.encode(t) for t in corpus]


def test_round_trip(tok: TextTokenizer, hf_tok: Any, corpus: list[str]) -> None:
    for text in corpus:
        ids = tok.encode(text)
        assert tok.decode(ids, skip_special_tokens=False) == text
        assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True)


def test_special_tokens_in_text_are_kept_when_asked(tok: TextTokenizer) -> None:
    ids = tok.encode("<|im_start|>user")
    assert ids[0] == tok.special.bos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == "user"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user"


CONVERSATIONS = [
    [Message("user", "What is the capital of France?")],
    [Message("system", "You answer in French."), Message("user", "Bonjour 👋")],
    [
        Message("user", "Write code"),
        Message("assistant", "def f():\n    pass"),
        Message("user", "Now in Rust, 中文 comments please."),
    ],
    [Message("user", "")],
]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conv", CONVERSATIONS, ids=lambda c: f"{len(c)}msgs")
def test_chat_template_matches_reference(
    tok: TextTokenizer, hf_tok: Any, conv: list[Message], add_generation_prompt: bool
) -> None:
    msgs = [{"role": m.role, "content": m.content} for m in conv]
    ref_text = hf_tok.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    ids, text = tok.encode_chat(conv, add_generation_prompt)
    assert text == ref_text
    ref_ids = hf_tok.apply_chat_template(
        msgs, tokenize=True, add_generation_prompt=add_generation_prompt
    )
    if isinstance(ref_ids, dict) or hasattr(ref_ids, "input_ids"):
        ref_ids = ref_ids["input_ids"]
    assert ids == list(ref_ids)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda t: t.encode(""), "text is empty"),
        (lambda t: t.encode("x" * 2_000_001), "the limit is"),
        (lambda t: t.encode_chat([]), "messages is empty"),
        (lambda t: t.encode_chat([Message("wizard", "hi")]), "valid roles"),
        (lambda t: t.decode([0, 49152]), "outside the vocabulary"),
        (lambda t: t.decode([-1]), "outside the vocabulary"),
        (lambda t: t.encode_batch(["ok", ""]), "texts[1] is empty"),
    ],
)
def test_bad_input_is_rejected_with_a_clear_message(
    model_dir: Any, call: Any, message: str
) -> None:
    t = TextTokenizer(model_dir, max_input_chars=2_000_000)
    with pytest.raises(TokenizerInputError, match=message.replace("[", r"\[").replace("]", r"\]")):
        call(t)


def test_missing_model_dir_says_how_to_fix(tmp_path: Any) -> None:
    with pytest.raises(FileNotFoundError, match="make model"):
        TextTokenizer(tmp_path)


def test_template_raise_exception_is_an_input_error(model_dir: Any, tmp_path: Any) -> None:
    import json
    import shutil

    for name in ("tokenizer.json", "generation_config.json"):
        shutil.copy(model_dir / name, tmp_path / name)
    cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    cfg["chat_template"] = (
        "{% if messages[0]['role'] != 'user' %}"
        "{{ raise_exception('Conversations must start with a user message') }}{% endif %}"
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    t = TextTokenizer(tmp_path)
    with pytest.raises(TokenizerInputError, match="must start with a user message"):
        t.encode_chat([Message("assistant", "hi")])
    assert t.encode_chat([Message("user", "hi")])[1] == "hi"
