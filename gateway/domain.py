"""Front-agnostic values of the pipeline: call context, chunks, errors, deadlines, traces.

The bottom floor of the gateway: this module imports nothing from its packages
(``Trace`` is the shape of ``gateway.spans.RequestTrace``, which sits beside it).

A front (the gRPC servicer today, the OpenAI-compatible HTTP front later)
builds a ``CallContext`` from its headers, iterates ``Pipeline.generate`` and
turns ``Chunk``s and ``GatewayError``s into its own wire format. Status codes
are ``grpc.StatusCode`` values because they are the contract's vocabulary
(docs/architecture.md, "Status codes"); an HTTP front maps them to HTTP statuses.
"""

from __future__ import annotations

import contextlib
import math
import re
import secrets
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import grpc

from llm.v1 import common_pb2

if TYPE_CHECKING:
    from opentelemetry.trace import Span

    from ratelimit.budget.policy import Budget
    from ratelimit.config import Tenant

_REQUEST_ID_RE = re.compile(r"^[\x21-\x7e]{1,128}$")
_TRACEPARENT_RE = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")
RETRY_AFTER_KEY = "retry-after-ms"
SESSION_KEY_HEADER = "x-session-id"  # sticky version routing of one conversation
MAX_SESSION_KEY_CHARS = 256


def session_key(header: str, user: str = "") -> str:
    """The sticky routing key of a request: the ``x-session-id`` header (metadata), else
    the OpenAI body's ``user``; cut to ``MAX_SESSION_KEY_CHARS``."""
    return (header or user)[:MAX_SESSION_KEY_CHARS]


Metadata = tuple[tuple[str, str | bytes], ...]


class Trace(Protocol):
    """The spans of one request while tracing is on (``gateway.spans.RequestTrace``)."""

    def record(self, name: str, start: float, end: float) -> None:
        """A finished child span between two ``time.perf_counter()`` readings."""

    def stage(self, name: str) -> contextlib.AbstractContextManager[object]:
        """A child span around a block."""

    def engine_call(self, replica: str, request_id: str, resumed_tokens: int) -> Span:
        """The CLIENT span of one engine attempt."""

    def finish(self, code: grpc.StatusCode, attributes: dict[str, str | int]) -> None:
        """End the request span with its final status and what it used."""


class GatewayError(Exception):
    """A request ends with this status; ``message`` tells the caller what to do.

    Attributes:
        code: The gRPC status code.
        message: A sentence a person can act on.
        retry_after_ms: Set for RESOURCE_EXHAUSTED (and some UNAVAILABLE) answers.
        trailers: Extra trailing metadata (e.g. ``QuotaFailure`` details of a denial).
        dimension: For tenant-limit denials: which limits were short (for metrics).
    """

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        *,
        retry_after_ms: int | None = None,
        trailers: Metadata = (),
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after_ms = retry_after_ms
        self.trailers = trailers

    def metadata(self) -> Metadata:
        """Trailing metadata: ``retry-after-ms`` (when set) plus ``trailers``."""
        md = list(self.trailers)
        if self.retry_after_ms is not None and not any(k == RETRY_AFTER_KEY for k, _ in md):
            md.append((RETRY_AFTER_KEY, str(self.retry_after_ms)))
        return tuple(md)


def new_traceparent(parent: str | None) -> tuple[str, str]:
    """(traceparent to send downstream, trace id) for a W3C ``traceparent`` header.

    A valid incoming header keeps its trace id and flags and gets a new span
    id (the gateway's span); a missing or malformed one starts a new trace.
    """
    m = _TRACEPARENT_RE.match(parent.strip().lower()) if parent else None
    if m and m.group(1) != "ff" and int(m.group(2), 16) and int(m.group(3), 16):
        trace_id, flags = m.group(2), m.group(4)
    else:
        trace_id, flags = secrets.token_hex(16), "01"
    return f"00-{trace_id}-{secrets.token_hex(8)}-{flags}", trace_id


def parent_span_id(parent: str, trace_id: str) -> str:
    """The caller's span id in a ``traceparent`` that ``new_traceparent`` kept the trace
    of (``trace_id``); "" when it started a new trace."""
    m = _TRACEPARENT_RE.match(parent.strip().lower()) if parent else None
    return m.group(3) if m and m.group(2) == trace_id else ""


def client_source(forwarded_for: str, peer: str) -> str:
    """The client address of a call: the last ``x-forwarded-for`` entry (the one the
    edge proxy appended; earlier ones are whatever the client sent), else ``peer``
    without its port (gRPC's ``ipv4:1.2.3.4:5678`` / ``ipv6:[::1]:5678`` or aiohttp's
    plain address). Cut to 64 characters: it is a label, logged and used as a key."""
    last = forwarded_for.rsplit(",", 1)[-1].strip()
    if last:
        return last[:64]
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        peer = rest.rsplit(":", 1)[0].strip("[]")
    return peer[:64]


@dataclass(slots=True)
class CallContext:
    """What a front knows about one call besides the request body.

    Attributes:
        authorization: The ``authorization`` header/metadata value ("" when absent).
        request_id: Client-chosen id ("" = generate one).
        traceparent: Incoming W3C traceparent ("" = start a trace).
        timeout_s: Client deadline in seconds from now (None = the configured default).
        tenant: The caller's tenant when the front already authenticated the key
            (the HTTP front does, before it reads the body); None = the pipeline does.
        session_key: Sticky routing key of a conversation (gRPC: ``x-session-id``
            metadata; HTTP: the ``x-session-id`` header or the body's ``user``);
            "" = none. Requests with one key stay on one model version.
        source: The client's address (the last ``x-forwarded-for`` hop, which Envoy
            appends, else the connection's peer); "" = unknown. Failed
            authentications are counted per source.
        ratelimit: Set by the pipeline: the ``x-ratelimit-*`` headers of its
            admission decisions.
        auth_at: ``time.perf_counter()`` before and after a front's own authentication
            (the HTTP front's, before it reads the body): the auth span of a trace.
        trace: The request's spans while tracing is on (set by the pipeline).
    """

    authorization: str = ""
    request_id: str = ""
    traceparent: str = ""
    timeout_s: float | None = None
    session_key: str = ""
    tenant: Tenant | None = None
    source: str = ""
    trace_id: str = field(default="", init=False)
    client_traceparent: str = field(default="", init=False)  # as the client sent it
    request_id_error: str = field(default="", init=False)
    # OpenAI's x-ratelimit-* headers of the admission decisions so far (the fronts send
    # them as response headers / gRPC metadata, on answers and refusals alike)
    ratelimit: dict[str, str] = field(default_factory=dict, init=False)
    key_id: str = field(default="", init=False)
    key_budgets: tuple[Budget, ...] = field(default=(), init=False)
    auth_at: tuple[float, float] | None = field(default=None, init=False)
    trace: Trace | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if self.request_id and not _REQUEST_ID_RE.match(self.request_id):
            self.request_id_error = (
                "request_id must be 1-128 printable ASCII characters without spaces "
                "(leave it empty to get a generated one)"
            )
            self.request_id = ""
        self.request_id = self.request_id or uuid.uuid4().hex
        self.client_traceparent = self.traceparent
        self.traceparent, self.trace_id = new_traceparent(self.traceparent)


_UNSAFE_ID_CHARS = re.compile(r"[^A-Za-z0-9_-]")


def engine_request_id(tenant_id: str) -> str:
    """The id the gateway gives one request at the engines.

    A client's ``request_id`` / ``x-request-id`` is a correlation id only: it
    never reaches an engine, so no client can name (cancel, collide with,
    read) a stream it did not start. This id is 128 random bits, unguessable
    and unique, prefixed by the tenant (as a readable, log-safe label).
    """
    label = _UNSAFE_ID_CHARS.sub("_", tenant_id)[:48] or "tenant"
    return f"{label}.{secrets.token_hex(16)}"


class Deadline:
    """One deadline across every attempt of a request (monotonic clock).

    Args:
        seconds: From now; must be a positive finite number (a client's value
            goes through ``for_client``).
    """

    def __init__(self, seconds: float) -> None:
        if not 0.0 < seconds < float("inf"):
            raise ValueError(f"a deadline must be a positive number of seconds, got {seconds}")
        self._at = time.monotonic() + seconds
        self._wall_at = time.time() + seconds

    @classmethod
    def for_client(cls, requested: float | None, default_s: float, maximum_s: float) -> Deadline:
        """The deadline of a request: the client's (cut to ``maximum_s``) or ``default_s``.

        Raises:
            GatewayError: INVALID_ARGUMENT for a deadline that is not a positive
                finite number, or DEADLINE_EXCEEDED when none is left.
        """
        if requested is None:
            return cls(min(default_s, maximum_s))
        if math.isnan(requested) or requested < 0:
            raise GatewayError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"the request deadline must be a positive number of seconds, got {requested}",
            )
        if requested == 0:
            raise GatewayError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                "the request deadline had passed before the gateway got it",
            )
        return cls(min(requested, maximum_s))

    def remaining(self) -> float:
        """Seconds left (never negative)."""
        return max(0.0, self._at - time.monotonic())

    @property
    def expired(self) -> bool:
        """True once no time is left."""
        return self.remaining() <= 0.0

    @property
    def wall_time(self) -> float:
        """The deadline as unix seconds (for the engine's absolute ``deadline`` field)."""
        return self._wall_at


@dataclass(slots=True)
class Chunk:
    """One streamed piece of a completion.

    ``text`` is the delta since the previous chunk and ``token_ids`` the
    tokens behind it; ``finish_reason`` and ``usage`` are set on the last
    chunk only; ``model``/``model_version`` on the first.
    """

    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[common_pb2.PositionLogprobs] = field(default_factory=list)
    finish_reason: int = common_pb2.FINISH_REASON_UNSPECIFIED
    usage: common_pb2.Usage | None = None
    model: str = ""
    model_version: str = ""
    tool_calls: list[common_pb2.ToolCall] = field(default_factory=list)  # deltas
    reasoning_text: str = ""  # reasoning models: the thought's delta, apart from text
    index: int = 0  # which sample (GenerateRequest.n), 0-based
