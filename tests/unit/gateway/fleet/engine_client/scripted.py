"""Scripted standard-protocol engines on loopback gRPC for the engine-client tests: what
they were sent is recorded, what they answer is set by the test."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import zipfile
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any

import grpc
from smg_grpc_proto.generated import common_pb2  # type: ignore[import-untyped]

from tokenizer_svc.tokenizer import read_tokenizer_files


def tokenizer_zip(model_dir: Path, extra: Mapping[str, bytes] | None = None) -> bytes:
    """The model's tokenizer files zipped in a folder, as a stock servicer sends them
    (with files the gateway does not use)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in {**read_tokenizer_files(model_dir), **(extra or {})}.items():
            zf.writestr(f"model/{name}", data)
        zf.writestr("model/special_tokens_map.json", b"{}")
    return buf.getvalue()


def zip_chunks(data: bytes, sha: str | None = None, size: int = 1 << 20) -> list[Any]:
    """GetTokenizerChunk messages of ``data``, the sha256 on the last."""
    pieces = [data[i : i + size] for i in range(0, len(data), size)] or [b""]
    out = [common_pb2.GetTokenizerChunk(data=p) for p in pieces]
    out[-1].sha256 = hashlib.sha256(data).hexdigest() if sha is None else sha
    return out


class Script:
    """Shared recording of a scripted engine."""

    def __init__(self) -> None:
        self.requests: list[Any] = []
        self.aborted: list[str] = []
        self.metadata: list[dict[str, str]] = []
        self.responses: list[Any] = []  # what Generate streams
        self.hang = False  # after the responses, wait until cancelled
        self.cancelled = asyncio.Event()
        self.zip_chunks: list[Any] = []

    async def stream(self, request: Any, context: Any) -> Any:
        self.requests.append(request)
        self.metadata.append({k: str(v) for k, v in context.invocation_metadata()})
        for resp in self.responses:
            yield resp
        if self.hang:
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                self.cancelled.set()
                raise


class ScriptedGenerate:
    """A scripted servicer's Generate: ``script`` records each call and answers it
    (``paused``: what its server info says of draining)."""

    def __init__(self) -> None:
        self.script = Script()
        self.paused = False

    async def Generate(self, request: Any, context: Any) -> AsyncIterator[Any]:
        async for resp in self.script.stream(request, context):
            yield resp


async def start(add: Any, servicer: Any) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    add(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


@contextlib.asynccontextmanager
async def serving(
    add: Any, servicer: Any, client: Callable[[str], Any]
) -> AsyncIterator[tuple[Any, Any]]:
    """``servicer`` on loopback and ``client(address)`` to it, both closed after."""
    server, address = await start(add, servicer)
    c = client(address)
    try:
        yield servicer, c
    finally:
        await c.close()
        await server.stop(0)


async def until(what: str, ready: Any, limit_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + limit_s
    while not ready():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"gave up after {limit_s} s waiting for {what}")
        await asyncio.sleep(0.01)


async def cancel_after_first_chunk(client: Any, request: Any, script: Script) -> None:
    """Start ``request`` on an engine that streams and then hangs, cancel it after its
    first chunk, and wait for the engine to receive the Abort of its id."""
    script.hang = True
    stream = client.generate(request, timeout=10, metadata=())
    async for _ in stream:
        break
    stream.cancel()
    await until("the Abort", lambda: script.aborted == [request.request_id])
