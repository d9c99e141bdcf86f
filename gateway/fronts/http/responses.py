"""Pipeline ``Chunk``s -> OpenAI response objects (chat and text completions, streamed or not).

    streamed chat:   {role} chunk, {content} / {reasoning_content} chunks, one chunk per
                     tool call delta ({"tool_calls": [{index, id, type, function: {name,
                     arguments: ""}}]} then {"tool_calls": [{index, function: {arguments}}]}),
                     last chunk with finish_reason, [usage chunk with "choices": []],
                     then the SSE "[DONE]"
    streamed text:   {text} chunks, last chunk with finish_reason, [usage chunk]
    non-streamed:    one object with the whole text, finish_reason and usage

With ``n`` > 1 each sample is a choice (``index``), streamed interleaved as its chunks
come; the usage counts the prompt once and every sample's output.

Every object of one request shares ``id`` (``chatcmpl-<request id>`` or
``cmpl-<request id>``), ``created`` and ``model``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
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


@dataclass(slots=True)
class _Sample:
    """What one choice (sample) has received so far."""

    text: list[str] = field(default_factory=list)
    positions: list[common_pb2.PositionLogprobs] = field(default_factory=list)
    finish_reason: int = common_pb2.FINISH_REASON_UNSPECIFIED
    usage: common_pb2.Usage | None = None
    reasoning: list[str] = field(default_factory=list)
    calls: dict[int, Json] = field(default_factory=dict)  # tool calls, merged from deltas
    num_chars: int = 0  # text completions' logprob offsets


class Formatter:
    """Builds the response objects of one request (one choice per sample, ``n``).

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
        self.samples = [_Sample() for _ in range(max(1, parsed.request.n))]

    @property
    def finish_reason(self) -> int:
        """CANCELLED when any sample was cut by the deadline, else the first sample's."""
        reasons = [s.finish_reason for s in self.samples]
        return common_pb2.CANCELLED if common_pb2.CANCELLED in reasons else reasons[0]

    @property
    def usage(self) -> common_pb2.Usage | None:
        """The samples' usage together: the prompt once, every sample's output."""
        got = [s.usage for s in self.samples if s.usage is not None]
        if not got:
            return None
        return common_pb2.Usage(
            prompt_tokens=max(u.prompt_tokens for u in got),
            completion_tokens=sum(u.completion_tokens for u in got),
            cached_prompt_tokens=max(u.cached_prompt_tokens for u in got),
        )

    def add(self, chunk: Chunk) -> None:
        """Record one chunk (text, logprobs, finish, usage, calls) in its sample."""
        if chunk.model:
            self.model = chunk.model
        s = self.samples[chunk.index]
        s.text.append(chunk.text)
        if self.parsed.logprobs:
            s.positions.extend(chunk.logprobs)
        if chunk.finish_reason:
            s.finish_reason = chunk.finish_reason
        if chunk.usage is not None:
            s.usage = chunk.usage
        s.reasoning.append(chunk.reasoning_text)
        for tc in chunk.tool_calls:
            call = s.calls.setdefault(
                tc.index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
            )
            call["id"] = tc.id or call["id"]
            call["function"]["name"] += tc.name
            call["function"]["arguments"] += tc.arguments

    def _head(self, kind: str) -> Json:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def _logprobs(self, s: _Sample, positions: list[common_pb2.PositionLogprobs]) -> Json | None:
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
            offsets.append(s.num_chars)
            s.num_chars += len(p.chosen.text)
        return {
            "tokens": [p.chosen.text for p in positions],
            "token_logprobs": [p.chosen.logprob for p in positions],
            "top_logprobs": [{t.text: t.logprob for t in p.top[:n]} for p in positions],
            "text_offset": offsets,
        }

    def _choice(
        self,
        index: int,
        text: str,
        positions: list[common_pb2.PositionLogprobs],
        finish: int,
        *,
        delta: Json | None,
    ) -> Json:
        s = self.samples[index]
        choice: Json = {"index": index}
        if not self.chat:
            choice["text"] = text
        elif delta is not None:
            choice["delta"] = delta
        else:
            choice["message"] = self._message(s, text)
        choice["logprobs"] = self._logprobs(s, positions)
        choice["finish_reason"] = FINISH_REASONS.get(finish) if finish else None
        return choice

    @staticmethod
    def _message(s: _Sample, text: str) -> Json:
        message: Json = {"role": "assistant", "content": text or (None if s.calls else "")}
        reasoning = "".join(s.reasoning)
        if reasoning:
            message["reasoning_content"] = reasoning
        if s.calls:
            message["tool_calls"] = [s.calls[i] for i in sorted(s.calls)]
        return message

    def role_chunks(self) -> list[Json]:
        """The first chunks of a streamed chat: the assistant role per choice, no content."""
        out = []
        for i in range(len(self.samples)):
            obj = self._head("chat.completion.chunk")
            obj["choices"] = [
                {
                    "index": i,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ]
            out.append(self._stream_usage(obj))
        return out

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
                    chunk.index,
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
            self._choice(i, "".join(s.text), s.positions, s.finish_reason, delta=None)
            for i, s in enumerate(self.samples)
        ]
        out["usage"] = usage_json(self.usage or common_pb2.Usage())
        return out
