"""The ``tokenizer`` config section."""

from __future__ import annotations

import dataclasses

from common.config import DEFAULT_MODEL_NAME, ServiceConfig


@dataclasses.dataclass(slots=True)
class TokenizerConfig(ServiceConfig):
    """The tokenizer's gRPC service (``python -m tokenizer_svc``).

    Attributes:
        model_dir: The HF checkpoint whose tokenizer is served; "" = ``$LLM_MODEL_DIR``
            or the prepared default model.
        model_name: The model the tokenizer belongs to.
        max_input_chars: Longer texts are refused with INVALID_ARGUMENT.
        max_batch_size: Texts one EncodeBatch call may carry.
        max_message_bytes: Largest gRPC message accepted or sent (batches of long
            texts, up to ``max_input_chars`` each).
    """

    port: int = 50061
    model_dir: str = ""
    model_name: str = DEFAULT_MODEL_NAME
    max_input_chars: int = 1_000_000
    max_batch_size: int = 256
    max_message_bytes: int = 64 * 1024 * 1024
