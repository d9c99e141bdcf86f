"""Render a model's jinja2 chat template the way HF ``apply_chat_template`` does.

Same environment as transformers: sandboxed, ``trim_blocks``/``lstrip_blocks``,
``raise_exception``, a ``tojson`` that keeps non-ASCII, and ``strftime_now``.
Tools go to the template as transformers passes them (``tools``: a list of
``{"type": "function", "function": {...}}``, or None), and an assistant turn's
calls as ``tool_calls`` (``{"id", "type", "function": {"name", "arguments"}}``,
arguments decoded to an object); ``supports_tools`` says whether the template
reads ``tools`` at all (``tokenizer_svc.tool_prompt`` renders them otherwise).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from jinja2 import TemplateError, meta
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

VALID_ROLES = frozenset({"system", "user", "assistant", "tool"})


class ChatTemplateError(ValueError):
    """The messages cannot be rendered (bad role, template raised)."""


@dataclass(slots=True, frozen=True)
class Message:
    """One chat turn as the template sees it (tool fields only where set)."""

    role: str
    content: str
    tool_calls: tuple[dict[str, Any], ...] = ()
    tool_call_id: str = ""
    name: str = ""

    def as_dict(self) -> dict[str, Any]:
        """The message object the template iterates over."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = list(self.tool_calls)
        if self.tool_call_id:
            out["tool_call_id"] = self.tool_call_id
        if self.name:
            out["name"] = self.name
        return out


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"chat template rejected the messages: {message}")


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    """A compiled chat template plus the special tokens it may reference."""

    def __init__(self, source: str, special_tokens: dict[str, str | None]) -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        self._template = env.from_string(source)
        self._special = special_tokens
        self.source = source
        self.supports_tools = "tools" in meta.find_undeclared_variables(env.parse(source))

    def render(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        tools: Sequence[dict[str, Any]] | None = None,
    ) -> str:
        """Render ``messages``. Raises ChatTemplateError with an actionable message."""
        if not messages:
            raise ChatTemplateError("messages is empty: send at least one message")
        for i, m in enumerate(messages):
            if m.role not in VALID_ROLES:
                raise ChatTemplateError(
                    f"messages[{i}].role is {m.role!r}; valid roles: {sorted(VALID_ROLES)}"
                )
        try:
            return self._template.render(
                messages=[m.as_dict() for m in messages],
                add_generation_prompt=add_generation_prompt,
                tools=list(tools) if tools else None,
                **self._special,
            )
        except ChatTemplateError:
            raise
        except (TemplateError, SecurityError) as e:
            raise ChatTemplateError(f"chat template failed to render: {e}") from e


__all__ = ["VALID_ROLES", "ChatTemplate", "ChatTemplateError", "Message"]
