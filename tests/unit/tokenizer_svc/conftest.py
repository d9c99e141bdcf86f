from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tokenizer_svc.tokenizer import TextTokenizer

DATA = Path(__file__).resolve().parents[2] / "data"


@pytest.fixture(scope="session")
def tok(model_dir: Path) -> TextTokenizer:
    return TextTokenizer(model_dir)


@pytest.fixture(scope="session")
def hf_tok(model_dir: Path) -> Any:
    """transformers' tokenizer: the reference (a test dependency only)."""
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(model_dir))


@pytest.fixture(scope="session")
def corpus() -> list[str]:
    text = (DATA / "tokenizer_corpus.txt").read_text(encoding="utf-8")
    lines = [ln for ln in text.split("\n") if ln]
    return [*lines, text]  # each line, and the whole file as one document
