"""Pipeline ``Chunk``s -> OpenAI response objects (chat and text completions, streamed or not).

    streamed chat:   {role} chunk, {content} / {reasoning_content} chunks, one chunk per
                     tool call delta ({"tool_calls": [{index, id, type, function: {name,
                     arguments: ""}}]} then {"tool_calls": [{index, function: {arguments}}]}),
                     last chunk with finish_reason, [usage chunk with "choices": []],
                     then the SSE "[DONE]"
    streamed text:   {text} chunks, last chunk with finish_reason, [usage chunk]
    non-streamed:    one object with the whole text, finish_reason and usage

Every object of one request shares ``id`` (``chatcmpl-<request id>`` or
``cmpl-<request id>``), ``created`` and ``model``.
"""

from __future__ import annotations

import time
from typing import Any

from gateway.domain import Chunk
from gateway.fronts.http.requests import ParsedRequest
from llm.v1 import common_pb2

FINISH_REASONS: dict[int, str] = {
    common_pb2.STOP: "stop",
    common_pb2.LENGTH: "length",
    common_pb2.TOOL_CALLS: "tool_calls",
}
Json = dict[str, Any]


def usage_json(u: common_pb2.Usage) -> Json:
    """OpenAI's usage object."""
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_prompt_tokens},
    }


def _call_delta(tc: common_pb2.ToolCall) -> Json:
    """One tool call delta: the first one of a call names it, the next ones add arguments."""
    if tc.name:
        return {
            "index": tc.index,
            "id": tc.id,
            "type": "function",
            "function": {"name": tc.name, "arguments": tc.arguments},
        }
    return {"index": tc.index, "function": {"arguments": tc.arguments}}


def _token(t: common_pb2.TokenLogprob) -> Json:
    return {"token": t.text, "logprob": t.logprob, "bytes": list(t.text.encode())}


class Formatter:
    """Builds the response objects of one request.

    Args:
        parsed: The converted request (kind, logprobs, usage options).
        request_id: The call's request id.
        model: The model asked for (replaced by the serving model once known).
    """

    def __init__(self, parsed: ParsedRequest, request_id: str, model: str) -> None:
        self.parsed = parsed
        self.chat = parsed.chat
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + request_id
        self.created = int(time.time())
        self.model = model
        self.text: list[str] = []
        self.positions: list[common_pb2.PositionLogprobs] = []
        self.finish_reason: int = common_pb2.FINISH_REASON_UNSPECIFIED
        self.usage: common_pb2.Usage | None = None
        self.reasoning: list[str] = []
        self.calls: dict[int, Json] = {}  # the tool calls, merged from their deltas
        self._num_chars = 0

    def add(self, chunk: Chunk) -> None:
        """Record one chunk (text, logprobs, finish, usage)."""
        if chunk.model:
            self.model = chunk.model
        self.text.append(chunk.text)
        if self.parsed.logprobs:
            self.positions.extend(chunk.logprobs)
        if chunk.finish_reason:
            self.finish_reason = chunk.finish_reason
        if chunk.usage is not None:
            self.usage = chunk.usage
        self.reasoning.append(chunk.reasoning_text)
        for tc in chunk.tool_calls:
            call = self.calls.setdefault(
                tc.index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
            )
            call["id"] = tc.id or call["id"]
            call["function"]["name"] += tc.name
            call["function"]["arguments"] += tc.arguments

    def _head(self, kind: str) -> Json:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def _logprobs(self, positions: list[common_pb2.PositionLogprobs]) -> Json | None:
        if not self.parsed.logprobs:
            return None
        n = self.parsed.top_logprobs
        if self.chat:
            return {
                "content": [
                    {**_token(p.chosen), "top_logprobs": [_token(t) for t in p.top[:n]]}
                    for p in positions
                ],
                "refusal": None,
            }
        offsets = []
        for p in positions:
            offsets.append(self._num_chars)
            self._num_chars += len(p.chosen.text)
        return {
            "tokens": [p.chosen.text for p in positions],
            "token_logprobs": [p.chosen.logprob for p in positions],
            "top_logprobs": [{t.text: t.logprob for t in p.top[:n]} for p in positions],
            "text_offset": offsets,
        }

    def _choice(
        self,
        text: str,
        positions: list[common_pb2.PositionLogprobs],
        finish: int,
        *,
        delta: Json | None,
    ) -> Json:
        choice: Json = {"index": 0}
        if not self.chat:
            choice["text"] = text
        elif delta is not None:
            choice["delta"] = delta
        else:
            choice["message"] = self._message(text)
        choice["logprobs"] = self._logprobs(positions)
        choice["finish_reason"] = FINISH_REASONS.get(finish) if finish else None
        return choice

    def _message(self, text: str) -> Json:
        message: Json = {"role": "assistant", "content": text or (None if self.calls else "")}
        reasoning = "".join(self.reasoning)
        if reasoning:
            message["reasoning_content"] = reasoning
        if self.calls:
            message["tool_calls"] = [self.calls[i] for i in sorted(self.calls)]
        return message

    def role_chunk(self) -> Json:
        """The first chunk of a streamed chat: the assistant role, no content yet."""
        out = self._head("chat.completion.chunk")
        out["choices"] = [
            {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        ]
        return self._stream_usage(out)

    def stream_chunk(self, chunk: Chunk) -> list[Json]:
        """The streamed objects of one chunk (none when it carries nothing to show): its
        text, then one per tool call delta; the finish reason on the last one."""
        self.add(chunk)
        deltas: list[Json] = []
        if chunk.text or chunk.reasoning_text or (self.parsed.logprobs and chunk.logprobs):
            delta: Json = {"content": chunk.text} if chunk.text else {}
            if chunk.reasoning_text:
                delta["reasoning_content"] = chunk.reasoning_text
            deltas.append(delta)
        deltas.extend({"tool_calls": [_call_delta(tc)]} for tc in chunk.tool_calls)
        if chunk.finish_reason and not deltas:
            deltas.append({})
        out = []
        for i, delta in enumerate(deltas):
            obj = self._head("chat.completion.chunk" if self.chat else "text_completion")
            last = i == len(deltas) - 1
            obj["choices"] = [
                self._choice(
                    chunk.text if i == 0 else "",
                    list(chunk.logprobs) if i == 0 else [],
                    chunk.finish_reason if last else 0,
                    delta=delta,
                )
            ]
            out.append(self._stream_usage(obj))
        return out

    def usage_chunk(self) -> Json:
        """The last streamed object when ``stream_options.include_usage``: usage, no choices."""
        out = self._head("chat.completion.chunk" if self.chat else "text_completion")
        out["choices"] = []
        out["usage"] = usage_json(self.usage or common_pb2.Usage())
        return out

    def _stream_usage(self, out: Json) -> Json:
        if self.parsed.include_usage:
            out["usage"] = None
        return out

    def final(self) -> Json:
        """The non-streamed response object."""
        out = self._head("chat.completion" if self.chat else "text_completion")
        out["choices"] = [
            self._choice("".join(self.text), self.positions, self.finish_reason, delta=None)
        ]
        out["usage"] = usage_json(self.usage or common_pb2.Usage())
        return out
