"""Parallel samples (n > 1): seeds per sample, the merge (index, every sample's end, the
first error closes the rest), and through the pipeline over a scripted engine: n engine
jobs with the same prompt and cache salt, each admitted and settled on its own."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator
from pathlib import Path

import grpc
import pytest

from gateway.domain import CallContext, Chunk, GatewayError
from gateway.request.pipeline import Pipeline
from gateway.request.samples import merged, sample_call, sample_requests
from llm.v1 import common_pb2, gateway_pb2
from tests.unit.gateway.request.fakes import TENANT, FakeDispatcher, limiter
from tests.unit.gateway.request.test_pipeline import pipeline_of
from tokenizer_svc.tokenizer import TextTokenizer


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> TextTokenizer:
    return TextTokenizer(model_dir)


def test_each_sample_has_its_own_seed() -> None:
    req = gateway_pb2.GenerateRequest(prompt="x", n=3)
    req.sampling.seed = (1 << 64) - 2
    subs = sample_requests(req)
    assert [s.n for s in subs] == [1, 1, 1]
    assert [s.sampling.seed for s in subs] == [(1 << 64) - 2, (1 << 64) - 1, 0]
    unseeded = sample_requests(gateway_pb2.GenerateRequest(prompt="x", n=2))
    assert not any(s.sampling.HasField("seed") for s in unseeded)


def test_a_samples_call_keeps_the_callers_key_and_id_checks() -> None:
    call = CallContext(request_id="bad id", authorization="Bearer k")
    call.key_id = "key-1"
    sub = sample_call(call)
    assert (sub.request_id, sub.request_id_error) == (call.request_id, call.request_id_error)
    assert sub.request_id_error  # a bad id is refused for every sample too
    assert (sub.authorization, sub.key_id) == ("Bearer k", "key-1")
    assert sub.ratelimit is not call.ratelimit


async def test_the_merge_names_each_sample_and_an_error_closes_the_rest() -> None:
    closed: list[int] = []

    async def generate(
        req: gateway_pb2.GenerateRequest, call: CallContext
    ) -> AsyncGenerator[Chunk, None]:
        seed = req.sampling.seed
        call.ratelimit["x-ratelimit-remaining-requests"] = str(seed)
        try:
            for k in range(3):
                await asyncio.sleep(0)
                if seed == 11 and k == 1:
                    raise GatewayError(grpc.StatusCode.UNAVAILABLE, "sample 1 failed")
                yield Chunk("r", text=f"{seed}.{k}", finish_reason=common_pb2.STOP if k == 2 else 0)
            if seed == 10:
                await asyncio.Event().wait()  # sample 0 hangs until closed
        finally:
            closed.append(seed)

    req = gateway_pb2.GenerateRequest(prompt="x", n=3)
    req.sampling.seed = 10
    call = CallContext()
    got: list[Chunk] = []

    async def consume() -> None:
        async with contextlib.aclosing(merged(generate, req, call)) as chunks:
            async for chunk in chunks:
                got.append(chunk)

    with pytest.raises(GatewayError, match="sample 1 failed"):
        await consume()
    assert sorted(closed) == [10, 11, 12]  # every sample's stream was closed
    assert {c.index for c in got} <= {0, 1, 2}
    assert all(c.text.startswith(f"{10 + c.index}.") for c in got)
    assert call.ratelimit["x-ratelimit-remaining-requests"] in {"10", "11", "12"}


async def collect(pipeline: Pipeline, req: gateway_pb2.GenerateRequest) -> list[Chunk]:
    async with contextlib.aclosing(pipeline.generate(req, CallContext(tenant=TENANT))) as chunks:
        return [c async for c in chunks]


async def test_n_samples_through_the_pipeline(tokenizer: TextTokenizer) -> None:
    lim, engine = limiter(), FakeDispatcher()
    async with pipeline_of(tokenizer, engine, lim) as pipeline:
        req = gateway_pb2.GenerateRequest(prompt="The capital of France is", n=3)
        req.sampling.max_tokens = 8
        req.sampling.seed = 5
        got = await collect(pipeline, req)
        assert len(engine.jobs) == 3
        assert len({tuple(j.prompt_token_ids) for j in engine.jobs}) == 1
        assert len({j.cache_salt for j in engine.jobs}) == 1
        assert sorted(j.sampling.seed for j in engine.jobs) == [5, 6, 7]
        for i in range(3):
            mine = [c for c in got if c.index == i]
            assert [t for c in mine for t in c.token_ids] == list(engine.tokens)
            assert mine[-1].finish_reason
        assert len(lim.settles) == 3  # each sample admitted and settled on its own
        too_many = gateway_pb2.GenerateRequest(prompt="x", n=pipeline.config.max_n + 1)
        with pytest.raises(GatewayError, match="max_n") as info:
            await collect(pipeline, too_many)
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
