"""Server-Sent Events over an aiohttp ``StreamResponse``, written as they come (never buffered).

Wire format, one event per JSON object, as OpenAI streams it::

    HTTP/1.1 200 OK
    Content-Type: text/event-stream; charset=utf-8
    Cache-Control: no-cache
    X-Accel-Buffering: no

    data: {"id":"chatcmpl-...","object":"chat.completion.chunk",...}
    <blank line>
    data: [DONE]
    <blank line>

Headers go out with the first event, so an error before it is still a plain
HTTP status. Each ``send`` awaits the socket's drain: a slow reader slows
the stream down (back-pressure) instead of growing a buffer in the gateway.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

DONE = b"data: [DONE]\n\n"
CONTENT_TYPE = "text/event-stream"


def encode_event(obj: Any) -> bytes:
    """One ``data:`` event (compact JSON, UTF-8, no newline inside)."""
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


class EventStream:
    """One SSE response.

    Args:
        request: The HTTP request being answered.
        headers: Extra response headers (``x-request-id``).
    """

    def __init__(self, request: web.Request, headers: dict[str, str] | None = None) -> None:
        self.request = request
        self.response = web.StreamResponse(
            status=200,
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})},
        )
        self.response.content_type = CONTENT_TYPE
        self.response.charset = "utf-8"

    @property
    def started(self) -> bool:
        """True once the headers were sent."""
        return self.response.prepared

    async def send(self, obj: Any) -> None:
        """Send one event (sending the headers first when needed)."""
        await self._write(encode_event(obj))

    async def close(self) -> web.StreamResponse:
        """Send ``data: [DONE]`` and end the response."""
        await self._write(DONE)
        await self.response.write_eof()
        return self.response

    async def _write(self, data: bytes) -> None:
        if not self.response.prepared:
            await self.response.prepare(self.request)
        await self.response.write(data)
