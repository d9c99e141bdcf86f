"""The ``tokenizer`` config section."""

from __future__ import annotations

import dataclasses

from common.config import DEFAULT_MODEL_NAME, ServiceConfig


@dataclasses.dataclass(slots=True)
class TokenizerConfig(ServiceConfig):
    port: int = 50061
    model_dir: str = ""  # empty = $LLM_MODEL_DIR or the prepared default
    model_name: str = DEFAULT_MODEL_NAME
    max_input_chars: int = 1_000_000
    max_batch_size: int = 256
    max_message_bytes: int = 64 * 1024 * 1024  # batches of long texts (max_input_chars each)
