"""Each model's tokenizer from its engines: the engine servicer's GetTokenizer over real
gRPC on loopback, and the gateway's TokenizerSet (one fetch per digest, files checked
against the digest the engine announced, a cap on what it holds)."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import grpc
import pytest

from engine_svc.service import TOKENIZER_PIECE_BYTES, EngineServicer
from gateway.fleet.engine_client.llm_v1 import LlmV1Client
from gateway.fleet.tokenizers import TokenizerFetchError, TokenizerSet
from llm.v1 import engine_pb2, engine_pb2_grpc
from tests.unit.engine_svc.test_validation_above_backends import RefusingBackend
from tokenizer_svc.chat_template import Message
from tokenizer_svc.tokenizer import (
    TextTokenizer,
    TokenizerFilesError,
    read_tokenizer_files,
    tokenizer_digest,
)


class CountingServicer(EngineServicer):
    """The real servicer, counting GetTokenizer calls; ``tamper`` flips a byte of what
    it sends (an engine whose files do not match its announced digest)."""

    def __init__(self, files: Mapping[str, bytes], tamper: bool = False) -> None:
        super().__init__(
            RefusingBackend(),  # type: ignore[arg-type]  # GetTokenizer never reaches it
            model_name="m",
            version="v",
            config_hash="h",
            build="b",
            tokenizer_files=files,
        )
        self.calls = 0
        self.tamper = tamper

    async def GetTokenizer(
        self, request: engine_pb2.GetTokenizerRequest, context: Any
    ) -> AsyncIterator[engine_pb2.TokenizerFilePiece]:
        self.calls += 1
        await asyncio.sleep(0.05)  # a fetch in flight while others ask for the same digest
        async for piece in super().GetTokenizer(request, context):
            if self.tamper and piece.name == "tokenizer_config.json":
                piece.data = piece.data[:-1] + b" "
            yield piece


async def serve(servicer: EngineServicer) -> tuple[grpc.aio.Server, LlmV1Client]:
    server = grpc.aio.server()
    engine_pb2_grpc.add_EngineServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, LlmV1Client(f"127.0.0.1:{port}")


@pytest.fixture(scope="module")
def files(model_dir: Path) -> dict[str, bytes]:
    return read_tokenizer_files(model_dir)


def test_files_and_directory_load_the_same_tokenizer(
    model_dir: Path, files: dict[str, bytes]
) -> None:
    from_dir = TextTokenizer(model_dir)
    from_bytes = TextTokenizer.from_files(files)
    assert from_bytes.digest == from_dir.digest == tokenizer_digest(files)
    assert from_bytes.model_dir is None
    text = "Tokenizers from bytes: ünïcode, 12345, <|im_end|>"
    assert from_bytes.encode(text) == from_dir.encode(text)
    msgs = [Message("user", "Hi")]
    assert from_bytes.encode_chat(msgs) == from_dir.encode_chat(msgs)


def test_digest_changes_with_any_byte_and_name(files: dict[str, bytes]) -> None:
    base = tokenizer_digest(files)
    changed = dict(files, **{"chat_template.jinja": files["chat_template.jinja"] + b" "})
    renamed = {("x" + k if k == "generation_config.json" else k): v for k, v in files.items()}
    assert len({base, tokenizer_digest(changed), tokenizer_digest(renamed)}) == 3
    assert tokenizer_digest(dict(reversed(list(files.items())))) == base  # order-free


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"tokenizer.json": None}, "missing ['tokenizer.json']"),
        ({"evil.py": b"import os"}, "unexpected ['evil.py']"),
        ({"tokenizer.json": b"{not json"}, "do not load"),
        ({"tokenizer_config.json": b"[1, 2]"}, "not a JSON object"),
    ],
)
def test_bad_files_are_refused_with_what_is_wrong(
    files: dict[str, bytes], edit: dict[str, bytes | None], message: str
) -> None:
    merged = {**files, **edit}
    bad = {k: v for k, v in merged.items() if v is not None}
    with pytest.raises(TokenizerFilesError, match=re.escape(message)):
        TextTokenizer.from_files(bad)


async def test_get_tokenizer_streams_the_files_in_pieces(files: dict[str, bytes]) -> None:
    servicer = CountingServicer(files)
    server, client = await serve(servicer)
    try:
        stub = client.stub
        pieces = [p async for p in stub.GetTokenizer(engine_pb2.GetTokenizerRequest())]
        info = await client.model_info(timeout_s=5)
    finally:
        await client.close()
        await server.stop(0)
    assert max(len(p.data) for p in pieces) <= TOKENIZER_PIECE_BYTES
    assert len(pieces) > len(files)  # tokenizer.json (3.5 MB) came in several
    joined: dict[str, bytes] = {}
    for p in pieces:
        joined[p.name] = joined.get(p.name, b"") + p.data
        assert p.digest == info.tokenizer_digest == tokenizer_digest(files)
    assert joined == files


async def test_concurrent_replicas_fetch_a_digest_once(files: dict[str, bytes]) -> None:
    servicer = CountingServicer(files)
    server, client = await serve(servicer)
    tokenizers = TokenizerSet()
    try:
        info = await client.model_info(timeout_s=5)
        assert tokenizers.get(info) is None  # not routable before it is held
        got = await asyncio.gather(*(tokenizers.ensure(info, client, "e1") for _ in range(5)))
    finally:
        await client.close()
        await server.stop(0)
    assert servicer.calls == 1
    assert all(t is got[0] for t in got)
    assert tokenizers.get(info) is got[0]
    assert len(tokenizers) == 1
    tokenizers.retain([])  # no replica reports it any more
    assert tokenizers.get(info) is None
    assert len(tokenizers) == 0


async def test_files_that_do_not_match_the_digest_are_refused(files: dict[str, bytes]) -> None:
    servicer = CountingServicer(files, tamper=True)
    server, client = await serve(servicer)
    tokenizers = TokenizerSet()
    try:
        info = await client.model_info(timeout_s=5)
        with pytest.raises(TokenizerFetchError, match="do not match their digest"):
            await tokenizers.ensure(info, client, "e1")
        assert tokenizers.get(info) is None
        servicer.tamper = False  # the next attempt (the replica's watch retries) succeeds
        await tokenizers.ensure(info, client, "e1")
    finally:
        await client.close()
        await server.stop(0)
    assert servicer.calls == 2
    assert tokenizers.get(info) is not None


async def test_an_engine_without_a_tokenizer(files: dict[str, bytes], model_dir: Path) -> None:
    servicer = CountingServicer({})
    server, client = await serve(servicer)
    try:
        stub = client.stub
        info = await client.model_info(timeout_s=5)
        assert info.tokenizer_digest == ""
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in stub.GetTokenizer(engine_pb2.GetTokenizerRequest()):
                pass
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        with pytest.raises(TokenizerFetchError, match=r"set gateway\.model_dir"):
            await TokenizerSet().ensure(info, client, "e1")
        local = TextTokenizer(model_dir)  # gateway.model_dir covers such engines
        assert await TokenizerSet(local).ensure(info, client, "e1") is local
    finally:
        await client.close()
        await server.stop(0)


async def test_the_number_of_distinct_tokenizers_is_capped(files: dict[str, bytes]) -> None:
    servicer = CountingServicer(files)
    server, client = await serve(servicer)
    tokenizers = TokenizerSet(max_tokenizers=1)
    try:
        info = await client.model_info(timeout_s=5)
        await tokenizers.ensure(info, client, "e1")
        other = engine_pb2.ModelInfo(model="m2", tokenizer_digest="0" * 64)
        with pytest.raises(TokenizerFetchError, match="already holds 1 distinct"):
            await tokenizers.ensure(other, client, "e2")
    finally:
        await client.close()
        await server.stop(0)
    assert servicer.calls == 1
