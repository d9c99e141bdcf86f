"""Validation of public SamplingParams and their mapping to the engine's params.

Every field is checked here, before any engine work, with a message that
names the field, the value and the valid range (INVALID_ARGUMENT). Zero
values mean "the default" as documented in common.proto. ``max_tokens`` is
resolved after encoding, against the prompt length and the model's context.
"""

from __future__ import annotations

import math

from llm.v1 import common_pb2, engine_pb2

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_LOGPROBS = 20
MAX_TEMPERATURE = 2.0
MAX_REPETITION_PENALTY = 10.0


def _finite(name: str, value: float) -> None:
    if not math.isfinite(value):
        raise ValueError(f"sampling.{name} must be a finite number, got {value}")


def _in_range(name: str, value: float, lo: float, hi: float, hint: str = "") -> None:
    _finite(name, value)
    if not lo <= value <= hi:
        raise ValueError(f"sampling.{name} must be in [{lo:g}, {hi:g}]{hint}, got {value:g}")


def validate_sampling(p: common_pb2.SamplingParams, vocab_size: int) -> None:
    """Check every field that does not depend on the prompt.

    Raises:
        ValueError: the message names the field and the valid range.
    """
    _in_range("temperature", p.temperature, 0.0, MAX_TEMPERATURE, " (0 = greedy)")
    _in_range("top_p", p.top_p, 0.0, 1.0, " (0 = 1.0, off)")
    _in_range("min_p", p.min_p, 0.0, 1.0, " (0 = off)")
    _in_range(
        "repetition_penalty", p.repetition_penalty, 0.0, MAX_REPETITION_PENALTY, " (0 = 1.0, off)"
    )
    _in_range("presence_penalty", p.presence_penalty, -2.0, 2.0)
    _in_range("frequency_penalty", p.frequency_penalty, -2.0, 2.0)
    if p.top_k > vocab_size:
        raise ValueError(
            f"sampling.top_k must be at most the vocabulary size {vocab_size} "
            f"(0 = off), got {p.top_k}"
        )
    if p.logprobs > MAX_LOGPROBS:
        raise ValueError(f"sampling.logprobs must be in [0, {MAX_LOGPROBS}], got {p.logprobs}")
    _check_stops(p)


def _check_stops(p: common_pb2.SamplingParams) -> None:
    if len(p.stop) > MAX_STOP_STRINGS:
        raise ValueError(
            f"sampling.stop has {len(p.stop)} strings; at most {MAX_STOP_STRINGS} are allowed"
        )
    for i, s in enumerate(p.stop):
        if not s:
            raise ValueError(f"sampling.stop[{i}] is empty: remove it or give a non-empty string")
        if len(s) > MAX_STOP_CHARS:
            raise ValueError(
                f"sampling.stop[{i}] is {len(s)} characters; at most {MAX_STOP_CHARS} are allowed"
            )
    if len(p.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise ValueError(
            f"sampling.stop_token_ids has {len(p.stop_token_ids)} ids; at most "
            f"{MAX_STOP_TOKEN_IDS} are allowed"
        )


def validate_stop_token_ids(p: common_pb2.SamplingParams, vocab_size: int) -> None:
    """Stop token ids must be inside the model's vocabulary."""
    for i, tid in enumerate(p.stop_token_ids):
        if tid >= vocab_size:
            raise ValueError(
                f"sampling.stop_token_ids[{i}] = {tid} is outside the vocabulary [0, {vocab_size})"
            )


def resolve_max_tokens(
    p: common_pb2.SamplingParams,
    num_prompt_tokens: int,
    max_context: int,
    default_max_tokens: int,
    max_max_tokens: int,
) -> int:
    """The output budget: the request's, or the default capped by what the context leaves.

    Raises:
        ValueError: the prompt fills the context, or max_tokens/min_tokens do not fit.
    """
    room = max_context - num_prompt_tokens
    if room < 1:
        raise ValueError(
            f"the prompt is {num_prompt_tokens} tokens; the model's context is "
            f"{max_context} tokens including the output: shorten the prompt"
        )
    if max_max_tokens and p.max_tokens > max_max_tokens:
        raise ValueError(
            f"sampling.max_tokens is {p.max_tokens}; this gateway allows at most {max_max_tokens}"
        )
    if p.max_tokens > room:
        raise ValueError(
            f"prompt ({num_prompt_tokens} tokens) + max_tokens ({p.max_tokens}) "
            f"exceeds the model's context of {max_context} tokens: lower "
            f"max_tokens to at most {room} or shorten the prompt"
        )
    max_tokens = p.max_tokens or min(default_max_tokens, room, max_max_tokens or default_max_tokens)
    if p.min_tokens > max_tokens:
        raise ValueError(f"sampling.min_tokens ({p.min_tokens}) exceeds max_tokens ({max_tokens})")
    return max_tokens


def engine_sampling(
    p: common_pb2.SamplingParams, max_tokens: int
) -> engine_pb2.EngineSamplingParams:
    """The engine's params (stop strings stay in the gateway; it matches them on text)."""
    out = engine_pb2.EngineSamplingParams(
        max_tokens=max_tokens,
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        min_p=p.min_p,
        repetition_penalty=p.repetition_penalty,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        min_tokens=p.min_tokens,
        logprobs=p.logprobs,
        stop_token_ids=p.stop_token_ids,
        ignore_eos=p.ignore_eos,
    )
    if p.HasField("seed"):
        out.seed = p.seed
    if p.HasField("guided"):
        out.guided.CopyFrom(p.guided)
    return out


_CLASSES = frozenset(
    (common_pb2.Priority.LOW, common_pb2.Priority.NORMAL, common_pb2.Priority.CRITICAL)
)


def request_priority(asked: int, tenant_class: int) -> common_pb2.Priority.ValueType:
    """The class a request runs in: the one it asks for, capped at its tenant's
    (unspecified = the tenant's; a tenant without a class is NORMAL).

    Raises:
        ValueError: ``asked`` is not a Priority value.
    """
    cap = tenant_class if tenant_class in _CLASSES else common_pb2.Priority.NORMAL
    if asked == common_pb2.Priority.PRIORITY_UNSPECIFIED:
        return common_pb2.Priority.ValueType(cap)
    if asked not in _CLASSES:
        raise ValueError(f"priority {asked} is not one of LOW (1), NORMAL (2), CRITICAL (3)")
    return common_pb2.Priority.ValueType(min(asked, cap))
