"""The engine-client seam: what the fleet asks of one engine, whatever protocol it speaks.

The gateway's own language is llm.v1: an ``EngineGenerateRequest`` goes in,
``EngineGenerateResponse`` chunks come out, load is an ``EngineStats`` and the model an
``ModelInfo``. One ``EngineClient`` per replica translates that to and from its wire
protocol (``llm_v1``, ``vllm``, ``trtllm``), so the replica, the pool, the dispatcher
and the pipeline never ask which protocol an engine speaks.

Failures keep gRPC's shape: a call that fails, or a request a protocol cannot carry
(``refuse``: INVALID_ARGUMENT naming the field and the engine), is a
``grpc.aio.AioRpcError``, as llm.v1's own errors are.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import grpc

from gateway.fleet.engine_client.kv_events import PromptBlocks
from llm.v1 import engine_pb2

Metadata = Sequence[tuple[str, str]]

CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
]


class TokenizerFetchError(Exception):
    """A replica's tokenizer could not be had; the replica stays out of routing."""


class NoTokenizerServed(TokenizerFetchError):
    """The engine serves no tokenizer (the gateway's own, ``gateway.model_dir``, may do)."""


class GenerateStream(Protocol):
    """One Generate call: llm.v1 chunks, ``cancel`` to stop it (the engine frees the
    request's KV blocks), ``done`` once it ended."""

    def __aiter__(self) -> AsyncIterator[engine_pb2.EngineGenerateResponse]: ...

    def done(self) -> bool: ...

    def cancel(self) -> bool: ...


class EngineClient(Protocol):
    """One engine replica over its wire protocol.

    ``announces_tokenizer``: ModelInfo names the tokenizer's digest before it is fetched
    (llm.v1), so a held tokenizer is not fetched again; otherwise the digest is learned
    by fetching (the standard protocols' GetTokenizer).
    """

    address: str
    protocol: str
    announces_tokenizer: bool

    def generate(
        self, request: engine_pb2.EngineGenerateRequest, *, timeout: float, metadata: Metadata
    ) -> GenerateStream:
        """Start a Generate call (``metadata``: request id and traceparent; the client
        adds its own credentials).

        Raises:
            grpc.aio.AioRpcError: INVALID_ARGUMENT when the protocol cannot carry a field.
        """
        ...

    async def model_info(self, timeout_s: float) -> engine_pb2.ModelInfo:
        """What the engine serves, as llm.v1 says it."""
        ...

    async def stats(self, timeout_s: float) -> engine_pb2.EngineStats:
        """The engine's load, the fields the router reads."""
        ...

    def watch_health(self) -> AsyncGenerator[str, None]:
        """Each health answer: "" = serving, else why not; raises
        ``grpc.aio.AioRpcError`` when the engine cannot be reached."""
        ...

    def cached_tokens(self, prompt: PromptBlocks) -> int:
        """Leading tokens of ``prompt`` the engine holds in its prefix cache, as its KV
        events said (0 where the protocol or the engine offers none)."""
        ...

    def prefix_blocks(self) -> int:
        """KV blocks the engine's events put in this client's prefix index (0 where the
        protocol or the engine offers none): whether the events reach the gateway."""
        ...

    async def tokenizer_files(self, digest: str, timeout_s: float) -> tuple[str, dict[str, bytes]]:
        """The tokenizer's digest and files (``digest``: the one ModelInfo announced,
        "" where the protocol announces none).

        Raises:
            TokenizerFetchError: none served, too large, or not what was announced.
        """
        ...

    async def close(self) -> None:
        """Close the channel (and anything the client still has in flight)."""
        ...


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """A call's failure as gRPC raises it, for one the client decides itself."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details, "")


def refuse(field: str, engine: str, why: str) -> grpc.aio.AioRpcError:
    """The INVALID_ARGUMENT of a request field a protocol cannot carry."""
    return rpc_error(
        grpc.StatusCode.INVALID_ARGUMENT, f"{field}: {why}; engine {engine} cannot carry it"
    )


@dataclass(frozen=True, slots=True)
class ChannelSecurity:
    """How engine channels are secured: plaintext, TLS, or mutual TLS (the client's
    certificate); the service token rides in metadata either way."""

    root_certificates: bytes | None = None
    private_key: bytes | None = None
    certificate_chain: bytes | None = None
    server_name: str = ""  # "" = each entry's configured host

    @classmethod
    def from_files(
        cls, ca_file: str, cert_file: str = "", key_file: str = "", server_name: str = ""
    ) -> ChannelSecurity:
        """From ``[gateway] engine_tls_*`` (no CA file: plaintext).

        Raises:
            ValueError: a file cannot be read.
        """
        if not ca_file:
            return cls()

        def read(path: str, what: str) -> bytes | None:
            if not path:
                return None
            try:
                return Path(path).read_bytes()
            except OSError as e:
                raise ValueError(f"[gateway] {what} {path!r}: {e.strerror}") from None

        return cls(
            read(ca_file, "engine_tls_ca_file"),
            read(key_file, "engine_tls_key_file"),
            read(cert_file, "engine_tls_cert_file"),
            server_name,
        )

    def channel(self, target: str, tls_name: str) -> grpc.aio.Channel:
        """A channel to ``target`` (``host:port``); TLS checks the certificate against
        ``server_name`` or else ``tls_name``."""
        if self.root_certificates is None:
            return grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)
        creds = grpc.ssl_channel_credentials(
            self.root_certificates, self.private_key, self.certificate_chain
        )
        options: list[tuple[str, Any]] = [
            *CHANNEL_OPTIONS,
            ("grpc.ssl_target_name_override", self.server_name or tls_name),
        ]
        return grpc.aio.secure_channel(target, creds, options=options)
