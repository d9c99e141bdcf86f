"""OpenAI request bodies -> ``llm.v1.GenerateRequest`` (plus what only the HTTP front needs).

Only the shape and the OpenAI-specific rules are checked here (types, ``n``,
``logprobs``/``top_logprobs``, unsupported features), each failure a 400
naming its ``param``. Ranges the pipeline checks anyway (temperature,
penalties, stop strings, max_tokens against the context) are left to it, so
gRPC and HTTP callers get the same limits. vLLM's extra sampling fields
(``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``,
``ignore_eos``, ``stop_token_ids``) are accepted too, so are structured outputs
and tools (``gateway.fronts.http.structured``), and ``priority``
(``"low"``, ``"normal"`` or ``"critical"``): the request's scheduling class,
capped at the tenant's by the pipeline.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.fronts.http.errors import ApiError
from gateway.fronts.http.fields import Fields
from gateway.fronts.http.structured import guided, tool_calls, tools
from llm.v1 import common_pb2, gateway_pb2

ROLES = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
}
MAX_TOP_LOGPROBS = 20
PRIORITIES = {
    "low": common_pb2.Priority.LOW,
    "normal": common_pb2.Priority.NORMAL,
    "critical": common_pb2.Priority.CRITICAL,
}
UINT64 = 1 << 64


@dataclass(slots=True)
class ParsedRequest:
    """One OpenAI request, converted.

    Attributes:
        chat: ``/v1/chat/completions`` (else ``/v1/completions``).
        request: The pipeline's request.
        stream: Answer as Server-Sent Events.
        include_usage: ``stream_options.include_usage``: a last chunk with usage.
        logprobs: Return log-probabilities.
        top_logprobs: Alternatives per position to return.
        user: The end user the caller names (logged, never interpreted).
    """

    chat: bool
    request: gateway_pb2.GenerateRequest
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    user: str = ""


def _content(f: Fields, i: int, content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text":
                raise ApiError.invalid(
                    f"messages[{i}].content[{j}]", "only text content parts are supported"
                )
            parts.append(f.typed(part.get("text"), str, f"messages[{i}].content[{j}].text"))
        return "".join(parts)
    raise ApiError.invalid(
        f"messages[{i}].content", "content must be a string or a list of text parts"
    )


def _messages(f: Fields) -> common_pb2.ChatMessages:
    raw = f.body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise ApiError.invalid(
            "messages", "messages must be a non-empty list of {role, content} objects"
        )
    out = common_pb2.ChatMessages()
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise ApiError.invalid(f"messages[{i}]", "each message must be an object")
        role = ROLES.get(str(m.get("role")))
        if role is None:
            raise ApiError.invalid(
                f"messages[{i}].role",
                f"role must be one of {', '.join(ROLES)}, got {m.get('role')!r}",
            )
        msg = out.messages.add(role=role, content=_content(f, i, m.get("content")))
        if m.get("tool_calls"):
            msg.tool_calls.extend(tool_calls(m["tool_calls"], f"messages[{i}].tool_calls"))
        if m.get("tool_call_id") is not None:
            msg.tool_call_id = f.typed(m["tool_call_id"], str, f"messages[{i}].tool_call_id")
        if m.get("name") is not None:
            msg.name = f.typed(m["name"], str, f"messages[{i}].name")
    return out


def _prompt(f: Fields) -> str:
    raw = f.body.get("prompt")
    if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], str):
        raw = raw[0]
    if not isinstance(raw, str):
        raise ApiError.invalid(
            "prompt",
            "prompt must be a string (or a list of one string); "
            "token-id prompts and batches are not supported",
        )
    return raw


def _stop(f: Fields) -> list[str]:
    raw = f.body.get("stop")
    if raw is None:
        return []
    if isinstance(raw, str):
        return [raw]
    if isinstance(raw, list) and all(isinstance(s, str) for s in raw):
        return list(raw)
    raise ApiError.invalid("stop", "stop must be a string or a list of strings")


def _sampling(f: Fields) -> common_pb2.SamplingParams:
    p = common_pb2.SamplingParams(stop=_stop(f))
    p.max_tokens = f.int_("max_completion_tokens", 1) or f.int_("max_tokens", 1) or 0
    p.temperature = f.number("temperature", 1.0)  # OpenAI's default; 0 = greedy
    p.top_p = f.number("top_p", 0.0)
    p.presence_penalty = f.number("presence_penalty", 0.0)
    p.frequency_penalty = f.number("frequency_penalty", 0.0)
    p.repetition_penalty = f.number("repetition_penalty", 0.0)
    p.min_p = f.number("min_p", 0.0)
    p.top_k = max(0, f.int_("top_k", -1) or 0)
    p.min_tokens = f.int_("min_tokens", 0) or 0
    p.ignore_eos = f.bool_("ignore_eos")
    p.stop_token_ids.extend(f.int_list("stop_token_ids"))
    seed = f.int_("seed", lo=-(1 << 63), hi=UINT64 - 1)
    if seed is not None:
        p.seed = seed % UINT64
    constraint = guided(f)
    if constraint is not None:
        p.guided.CopyFrom(constraint)
    return p


def _check_unsupported(f: Fields, chat: bool) -> None:
    if not chat:
        if f.bool_("echo"):
            raise ApiError.invalid("echo", "echo is not supported")
        if f.body.get("suffix"):
            raise ApiError.invalid("suffix", "suffix is not supported")
        if f.int_("best_of", 1) not in (None, 1):
            raise ApiError.invalid("best_of", "only best_of=1 is supported")
    if f.body.get("logit_bias"):
        raise ApiError.invalid("logit_bias", "logit_bias is not supported")
    if not chat and f.body.get("tools"):
        raise ApiError.invalid("tools", "tools need /v1/chat/completions")


def _priority(f: Fields) -> common_pb2.Priority.ValueType:
    name = f.str_("priority")
    if not name:
        return common_pb2.Priority.PRIORITY_UNSPECIFIED
    if name.lower() not in PRIORITIES:
        raise ApiError.invalid(
            "priority", f'priority must be "low", "normal" or "critical", got {name!r}'
        )
    return PRIORITIES[name.lower()]


def _logprobs(f: Fields, chat: bool) -> tuple[bool, int]:
    if chat:
        want = f.bool_("logprobs")
        top = f.int_("top_logprobs", 0, MAX_TOP_LOGPROBS)
        if top is not None and not want:
            raise ApiError.invalid("top_logprobs", "top_logprobs needs logprobs: true")
        return want, top or 0
    top = f.int_("logprobs", 0, MAX_TOP_LOGPROBS)
    return top is not None, top or 0


def parse(body: Any, *, chat: bool) -> ParsedRequest:
    """Convert one request body.

    Raises:
        ApiError: 400 with the ``param`` at fault.
    """
    if not isinstance(body, dict):
        raise ApiError.invalid(None, "the request body must be a JSON object")
    f = Fields(body)
    _check_unsupported(f, chat)
    req = gateway_pb2.GenerateRequest(
        model=f.str_("model"), sampling=_sampling(f), priority=_priority(f), n=f.int_("n", 1) or 1
    )
    if chat:
        req.messages.CopyFrom(_messages(f))
        tools(f, req)
    else:
        req.prompt = _prompt(f)
    stream = f.bool_("stream")
    options = f.body.get("stream_options")
    if options is not None and not stream:
        raise ApiError.invalid("stream_options", "stream_options needs stream: true")
    if options is not None and not isinstance(options, dict):
        raise ApiError.invalid("stream_options", "stream_options must be an object")
    include_usage = bool(
        options
        and f.typed(options.get("include_usage", False), bool, "stream_options.include_usage")
    )
    want, top = _logprobs(f, chat)
    # the engine returns the chosen token's logprob with at least one alternative
    req.sampling.logprobs = max(top, 1) if want else 0
    return ParsedRequest(
        chat=chat,
        request=req,
        stream=stream,
        include_usage=include_usage,
        logprobs=want,
        top_logprobs=top,
        user=f.str_("user"),
    )
