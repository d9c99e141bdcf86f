"""What the standard clients share: the tokenizer zip checks (engines are a trust
boundary), logprob ranks, resumption arithmetic, the cache salt, the refusals."""

from __future__ import annotations

import io
import zipfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from gateway.fleet.engine_client.base import TokenizerFetchError
from gateway.fleet.engine_client.standard import (
    cache_salt,
    check_request,
    position_logprobs,
    read_tokenizer_zip,
    resumed_prompt,
)
from llm.v1 import engine_pb2
from tests.unit.gateway.fleet.engine_client.scripted import tokenizer_zip, zip_chunks
from tokenizer_svc import tokenizer as tokenizer_module


async def read(chunks: list[Any]) -> tuple[str, dict[str, bytes]]:
    async def stream() -> AsyncIterator[Any]:
        for c in chunks:
            yield c

    return await read_tokenizer_zip(stream(), "vllm://e", lambda: None)


async def test_a_zip_gives_the_tokenizer_files_and_its_sha256(model_dir: Path) -> None:
    data = tokenizer_zip(model_dir)
    sha, files = await read(zip_chunks(data, size=100_000))
    assert len(sha) == 64
    assert files == tokenizer_module.read_tokenizer_files(model_dir)  # extras left out


async def test_a_sha256_that_does_not_match_is_refused(model_dir: Path) -> None:
    with pytest.raises(TokenizerFetchError, match="does not match its sha256"):
        await read(zip_chunks(tokenizer_zip(model_dir), sha="0" * 64))
    with pytest.raises(TokenizerFetchError, match="does not match its sha256"):
        await read(zip_chunks(tokenizer_zip(model_dir), sha=""))  # none sent


async def test_not_a_zip_or_no_tokenizer_json_is_refused() -> None:
    with pytest.raises(TokenizerFetchError, match="is not a zip"):
        await read(zip_chunks(b"plain bytes"))
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("tokenizer_config.json", b"{}")
    with pytest.raises(TokenizerFetchError, match=r"no tokenizer\.json"):
        await read(zip_chunks(buf.getvalue()))


async def test_sizes_are_capped_sent_and_unpacked(monkeypatch: pytest.MonkeyPatch) -> None:
    cap = 10_000
    monkeypatch.setattr("gateway.fleet.engine_client.standard.MAX_TOKENIZER_BYTES", cap)
    with pytest.raises(TokenizerFetchError, match="over 10000 bytes"):
        await read(zip_chunks(bytes(cap + 1), size=4096))
    buf = io.BytesIO()  # a small zip that unpacks past the cap
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("tokenizer.json", b" " * (cap * 5))
    assert len(buf.getvalue()) < cap
    with pytest.raises(TokenizerFetchError, match="unpacks to over"):
        await read(zip_chunks(buf.getvalue()))


def test_the_rank_is_the_chosen_tokens_place() -> None:
    pos = position_logprobs(7, -1.0, [(1, -0.2), (7, -1.0), (3, -0.5)], limit=5)
    assert (pos.rank, [a.token_id for a in pos.top]) == (3, [1, 3, 7])
    outside = position_logprobs(9, -3.0, [(1, -0.2), (3, -0.5)], limit=5)
    assert outside.rank == 3
    assert [a.token_id for a in position_logprobs(7, -1.0, [(1, -0.2), (7, -1.0)], 1).top] == [1]


def test_resumption_and_refusals() -> None:
    req = engine_pb2.EngineGenerateRequest(
        request_id="r",
        prompt_token_ids=[1, 2],
        sampling=engine_pb2.EngineSamplingParams(max_tokens=5, min_tokens=1),
        resumed_output_token_ids=[8, 9],
    )
    assert resumed_prompt(req) == ([1, 2, 8, 9], 3, 0)
    check_request(req, "vllm://e")  # nothing to refuse
    req.speculative_decoding = True
    with pytest.raises(grpc.aio.AioRpcError) as err:
        check_request(req, "trtllm://e")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == (
        "speculative_decoding: the protocol has no per-request speculative switch; "
        "engine trtllm://e cannot carry it"
    )


def test_the_cache_salt_is_per_salt_and_fits_int64() -> None:
    salts = {cache_salt(t) for t in ("tenant:a", "tenant:b", "group:a", "")}
    assert len(salts) == 4
    assert all(-(2**63) <= s < 2**63 for s in salts)
    assert cache_salt("tenant:a") == cache_salt("tenant:a")
