"""Request checks every backend shares, written once.

``validate_request`` holds what can be told from the request and the model's
facts alone (vocabulary, context length): the engine service runs it before
any backend sees a request, so the native engine and the TensorRT-LLM adapter
refuse the same inputs with the same messages, and ``LLMEngine`` runs it for
its offline callers. What only one engine knows (a live id, the size of its KV
pool) stays with that engine.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from engine_svc.core.sampling_params import SamplingParams

MAX_PRIORITY = 3  # llm.v1.Priority: 0 unspecified, 1 LOW, 2 NORMAL, 3 CRITICAL


def validate_request(
    request_id: str,
    prompt: Sequence[int],
    params: SamplingParams,
    priority: int,
    resumed: Sequence[int],
    *,
    vocab_size: int,
    max_model_len: int,
    tenant_weight: float = 1.0,
) -> None:
    """Raise ``ValueError`` with an actionable message when the request can never run.

    Args:
        resumed: output tokens a previous replica produced; they count against
            ``max_tokens`` and take context like the prompt.
        max_model_len: the context (prompt + output) one sequence may hold.
        tenant_weight: the tenant's fair share (> 0, finite).
    """
    if not request_id:
        raise ValueError("request_id must not be empty")
    if not prompt:
        raise ValueError("prompt_token_ids must not be empty")
    bad = next((t for t in itertools.chain(prompt, resumed) if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab_size})")
    if not 0 <= priority <= MAX_PRIORITY:
        raise ValueError(f"priority must be in [0, {MAX_PRIORITY}], got {priority}")
    if not 0 < tenant_weight < math.inf:
        raise ValueError(f"tenant_weight must be > 0 (0 = 1), got {tenant_weight}")
    params.validate(vocab_size)
    if len(resumed) >= params.max_tokens:
        raise ValueError(
            f"{len(resumed)} resumed output tokens already reach "
            f"max_tokens={params.max_tokens}; nothing is left to generate"
        )
    if len(prompt) + len(resumed) >= max_model_len:
        raise ValueError(
            f"prompt is {len(prompt) + len(resumed)} tokens; the context "
            f"holds {max_model_len}, leaving no room for output"
        )
    if len(prompt) + params.max_tokens > max_model_len:
        raise ValueError(
            f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) "
            f"exceeds the context of {max_model_len} tokens; lower max_tokens to "
            f"{max_model_len - len(prompt)} or less"
        )
