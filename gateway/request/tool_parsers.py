"""Tool-call parsers: a model's text -> content and calls, incrementally, per model family.

Each parser is fed the output's text deltas as they come (``feed``) and the end
(``finish``); each returns the content that is now safe to show and the calls completed
so far, whatever the split of the text into deltas (a tag cut in two is held back until
the next delta decides it). A call is ``(name, arguments)``, arguments as JSON text.

    hermes       <tool_call>{"name": F, "arguments": {...}}</tool_call>   (Hermes, Qwen;
                 the default prompt of templates without tools renders this format)
    llama3_json  {"name": F, "parameters": {...}}; {...}   (a reply that starts with "{")
    mistral      [TOOL_CALLS][{"name": F, "arguments": {...}}, ...]   (or the bare array:
                 the marker is a special token the detokenizer skips)

Text that looks like a call but does not parse stays content, unchanged. Whitespace
at the end of the content is held until more text follows; a reply that made calls
drops what is still held at its end.
"""

from __future__ import annotations

import json
from typing import Any

Call = tuple[str, str]
Parsed = tuple[str, list[Call]]
_DECODER = json.JSONDecoder()


def held_prefix(buf: str, tag: str) -> int:
    """Length of the longest suffix of ``buf`` that is a proper prefix of ``tag``."""
    for k in range(min(len(tag) - 1, len(buf)), 0, -1):
        if buf.endswith(tag[:k]):
            return k
    return 0


def as_call(value: Any, args_keys: tuple[str, ...] = ("arguments", "parameters")) -> Call | None:
    """``{"name": F, "arguments"|"parameters": {...}}`` as a call; None for anything else."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    for key in args_keys:
        if key in value:
            args = value[key]
            if isinstance(args, str):  # some models send the arguments as JSON text
                try:
                    args = json.loads(args)
                except ValueError:
                    return None
            if not isinstance(args, dict):
                return None
            return value["name"], json.dumps(args, ensure_ascii=False)
    return value["name"], "{}"


class ToolParser:
    """Shared part: content goes through ``_content``, which holds back whitespace."""

    name = ""

    def __init__(self) -> None:
        self._buf = ""
        self._ws = ""  # whitespace-only content, held until more text decides
        self.num_calls = 0

    def feed(self, text: str) -> Parsed:
        """Add a delta; the content and the calls it completes."""
        raise NotImplementedError

    def finish(self) -> Parsed:
        """At the end of the output: what is still held, as content or calls."""
        raise NotImplementedError

    def _content(self, text: str, *, last: bool = False) -> str:
        """Content to emit: trailing whitespace waits for more text (dropped at the end
        of a reply that made calls), so the result does not depend on the split."""
        text = self._ws + text
        if last:
            self._ws = ""
            return text if text.strip() or not self.num_calls else ""
        body = text.rstrip()
        self._ws = text[len(body) :]
        return body

    def _calls(self, calls: list[Call]) -> list[Call]:
        self.num_calls += len(calls)
        return calls


class HermesParser(ToolParser):
    """``<tool_call>`` JSON ``</tool_call>`` blocks, anywhere in the reply."""

    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        super().__init__()
        self._inside = False

    def feed(self, text: str) -> Parsed:
        self._buf += text
        content, calls = [], []
        while True:
            if self._inside:
                j = self._buf.find(self.CLOSE)
                if j < 0:
                    break
                body, self._buf = self._buf[:j], self._buf[j + len(self.CLOSE) :]
                self._inside = False
                call = self._parse(body)
                if call is None:
                    content.append(self._content(self.OPEN + body + self.CLOSE))
                else:
                    calls.append(call)
                continue
            i = self._buf.find(self.OPEN)
            if i < 0:
                hold = held_prefix(self._buf, self.OPEN)
                content.append(self._content(self._buf[: len(self._buf) - hold]))
                self._buf = self._buf[len(self._buf) - hold :]
                break
            content.append(self._content(self._buf[:i]))
            self._buf, self._inside = self._buf[i + len(self.OPEN) :], True
        return "".join(content), self._calls(calls)

    def finish(self) -> Parsed:
        buf, self._buf = self._buf, ""
        if self._inside:  # the reply ended before the closing tag
            self._inside = False
            call = self._parse(buf)
            if call is not None:
                return self._content("", last=True), self._calls([call])
            buf = self.OPEN + buf
        return self._content(buf, last=True), []

    @staticmethod
    def _parse(body: str) -> Call | None:
        try:
            return as_call(json.loads(body))
        except ValueError:
            return None


class JsonCallsParser(ToolParser):
    """JSON call objects one after another (separated by ``;`` or whitespace) after
    ``marker`` (none: a reply whose first character is ``{``); anything else is content."""

    name = "llama3_json"
    marker = ""
    bare_start = "\0"  # with a marker: how a reply starts whose marker the detokenizer dropped
    args_keys: tuple[str, ...] = ("parameters", "arguments")

    def __init__(self) -> None:
        super().__init__()
        self._mode = "start"  # start -> calls | content
        self._marked = False

    def feed(self, text: str) -> Parsed:
        self._buf += text
        if self._mode == "start":
            self._start()
        calls = self._decode() if self._mode == "calls" else []
        if self._mode == "content":
            out, self._buf = self._buf, ""
            return self._content(out), self._calls(calls)
        return "", self._calls(calls)

    def _start(self) -> None:
        head = self._buf.lstrip()
        if not head:
            return
        if not self.marker:
            self._mode = "calls" if head[0] == "{" else "content"
            return
        if head.startswith(self.marker):
            self._mode, self._buf, self._marked = "calls", head[len(self.marker) :], True
        elif head.startswith(self.bare_start):  # the marker was a special token, skipped
            self._mode = "calls"
        elif not self.marker.startswith(head):
            self._mode = "content"

    def _decode(self) -> list[Call]:
        calls: list[Call] = []
        while True:
            rest = self._buf.lstrip().lstrip(";").lstrip()
            if not rest:
                self._buf = ""
                return calls
            try:
                value, end = _DECODER.raw_decode(rest)
            except ValueError:
                self._buf = rest
                return calls  # incomplete (or not JSON: decided at the end)
            found = self._each(value)
            if found is None:
                self._mode = "content"  # JSON, but not calls: the rest is content
                self._buf = rest
                return calls
            calls.extend(found)
            self._buf = rest[end:]

    def _each(self, value: Any) -> list[Call] | None:
        call = as_call(value, self.args_keys)
        return None if call is None else [call]

    def finish(self) -> Parsed:
        if self._mode == "start" and self._buf.strip():
            self._mode = "content"
        calls = self._calls(self._decode()) if self._mode == "calls" else []
        buf, self._buf = self._buf, ""
        if buf.strip() and self._mode == "calls" and self._marked and not self.num_calls:
            buf = self.marker + buf
        return self._content(buf, last=True), calls


class MistralParser(JsonCallsParser):
    """``[TOOL_CALLS]`` then a JSON array of calls, at the start of the reply (Mistral's
    models put it first). ``[TOOL_CALLS]`` is a special token in Mistral's tokenizers,
    which the gateway's detokenizer skips: a reply starting with ``[{`` is read as the
    array (items that are not calls leave it content)."""

    name = "mistral"
    marker = "[TOOL_CALLS]"
    bare_start = "[{"
    args_keys = ("arguments", "parameters")

    def _each(self, value: Any) -> list[Call] | None:
        items = value if isinstance(value, list) else [value]
        calls = [as_call(v, self.args_keys) for v in items]
        if not calls or any(c is None for c in calls):
            return None
        return [c for c in calls if c is not None]


PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesParser, JsonCallsParser, MistralParser)
}


def parser_for_template(template_source: str) -> str:
    """The parser a chat template implies (hermes when it says nothing)."""
    if "[TOOL_CALLS]" in template_source:
        return MistralParser.name
    if "<|python_tag|>" in template_source or "ipython" in template_source:
        return JsonCallsParser.name
    return HermesParser.name
