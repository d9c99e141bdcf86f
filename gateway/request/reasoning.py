"""Reasoning models' thoughts kept apart from the answer (``reasoning_content``).

For a model family that marks its thought with ``<think>`` ... ``</think>`` (configured
per model: ``gateway.reasoning_parsers``, off by default), the text inside the tags
goes to ``reasoning_text`` and the rest stays content. Incremental like the stop
strings: a tag cut across deltas is held back until the next delta decides it.
"""

from __future__ import annotations

from gateway.request.tool_parsers import held_prefix


class ThinkSplitter:
    """Splits a stream of text deltas into (reasoning, content).

    Args:
        open_tag / close_tag: The marks around the thought.
    """

    def __init__(self, open_tag: str = "<think>", close_tag: str = "</think>") -> None:
        self.open_tag, self.close_tag = open_tag, close_tag
        self._buf = ""
        self._inside = False

    def feed(self, text: str) -> tuple[str, str]:
        """Add a delta; the (reasoning, content) now safe to emit."""
        self._buf += text
        reasoning: list[str] = []
        content: list[str] = []
        while True:
            tag = self.close_tag if self._inside else self.open_tag
            out = reasoning if self._inside else content
            i = self._buf.find(tag)
            if i < 0:
                hold = held_prefix(self._buf, tag)
                out.append(self._buf[: len(self._buf) - hold])
                self._buf = self._buf[len(self._buf) - hold :]
                break
            out.append(self._buf[:i])
            self._buf = self._buf[i + len(tag) :]
            self._inside = not self._inside
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """At the end: what was held back (a cut tag is text after all)."""
        buf, self._buf = self._buf, ""
        return (buf, "") if self._inside else ("", buf)
