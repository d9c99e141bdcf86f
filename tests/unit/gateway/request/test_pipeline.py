"""The pipeline over the in-memory limiter store and a scripted dispatcher (standing for
the engine fleet): every ending settles exactly once, the reserved tokens go back and
the concurrency lease is released, with no server."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path
from typing import cast

import grpc
import pytest

from common.breaker import BreakerPolicy
from gateway.config import GatewayConfig
from gateway.domain import CallContext, Chunk, GatewayError
from gateway.fleet.dispatcher import Dispatcher
from gateway.fleet.replica_pool import ReplicaPool
from gateway.fleet.tokenizers import TokenizerSet
from gateway.request.authenticate import Authenticator
from gateway.request.encode import Encoder
from gateway.request.pipeline import Pipeline
from llm.v1 import common_pb2, engine_pb2, gateway_pb2
from ratelimit.config import Tenant
from ratelimit.limiter.rate_limiter import RateLimiter
from ratelimit.tenancy.registry import Registry
from ratelimit.usage.records import UsageEvent, UsageLog
from tests.unit.gateway.request.fakes import (
    TENANT,
    CountingLimiter,
    FakeDispatcher,
    FlakyStore,
    limiter,
)
from tokenizer_svc.tokenizer import TextTokenizer

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> TextTokenizer:
    return TextTokenizer(model_dir)


class Usage:
    """A UsageLog that keeps what it is given."""

    def __init__(self) -> None:
        self.events: list[UsageEvent] = []

    def record(self, event: UsageEvent) -> None:
        self.events.append(event)


@contextlib.asynccontextmanager
async def pipeline_of(
    tokenizer: TextTokenizer, dispatcher: FakeDispatcher, lim: CountingLimiter
) -> AsyncIterator[Pipeline]:
    pool = ReplicaPool(["127.0.0.1:1"], BreakerPolicy())
    replica = pool.replicas[0]
    replica.healthy = True
    replica.info = engine_pb2.ModelInfo(
        model="m", version="v1", max_context_length=2048, vocab_size=tokenizer.vocab_size
    )
    encoder = Encoder("127.0.0.1:1")  # in process: its channel is never used
    try:
        yield Pipeline(
            GatewayConfig(),
            Authenticator(cast(Registry, None)),  # the call carries its tenant
            encoder,
            TokenizerSet(tokenizer),
            lim,
            pool,
            cast(Dispatcher, dispatcher),
            usage=cast(UsageLog, Usage()),
        )
    finally:
        await encoder.close()


def request(max_tokens: int = 8) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        prompt=PROMPT, sampling=common_pb2.SamplingParams(max_tokens=max_tokens)
    )


async def collect(pipeline: Pipeline, req: gateway_pb2.GenerateRequest) -> list[Chunk]:
    return await collect_as(pipeline, req, TENANT)


async def collect_as(
    pipeline: Pipeline, req: gateway_pb2.GenerateRequest, tenant: Tenant
) -> list[Chunk]:
    out = []
    async with contextlib.aclosing(pipeline.generate(req, CallContext(tenant=tenant))) as chunks:
        async for chunk in chunks:
            out.append(chunk)
    return out


async def totals(lim: RateLimiter) -> tuple[float, int, int, int]:
    """(tokens available, leases in use, prompt tokens charged, completion tokens charged)."""
    u = await lim.usage(TENANT)
    return u.tokens_available, u.concurrent_in_use, u.prompt_tokens_total, u.completion_tokens_total


async def test_a_finished_request_is_charged_its_usage_once_and_its_lease_released(
    tokenizer: TextTokenizer,
) -> None:
    lim, engine = limiter(), FakeDispatcher()
    async with pipeline_of(tokenizer, engine, lim) as pipeline:
        chunks = await collect(pipeline, request())
        prompt = len(engine.jobs[0].prompt_token_ids)
        assert [t for c in chunks for t in c.token_ids] == list(engine.tokens)
        assert (chunks[0].model, chunks[0].model_version) == ("m", "v1")
        assert chunks[-1].usage is not None
        assert chunks[-1].usage.completion_tokens == 4
        assert await totals(lim) == (6000 - prompt - 4, 0, prompt, 4)
        assert len(lim.settles) == 1
        assert pipeline.num_in_flight == 0
        usage = cast(Usage, pipeline.usage)
        event = usage.events[0]
        assert (event.status, event.prompt_tokens, event.completion_tokens) == ("OK", prompt, 4)
        assert (event.cached_prompt_tokens, event.model_version) == (2, "v1")
        # the second request of the tenant goes the overlapped way: settled the same
        await collect(pipeline, request())
        assert await totals(lim) == (6000 - 2 * (prompt + 4), 0, 2 * prompt, 8)
        assert len(lim.settles) == 2


async def test_a_client_gone_mid_stream_pays_for_the_prompt_and_what_it_got(
    tokenizer: TextTokenizer,
) -> None:
    lim, engine = limiter(), FakeDispatcher(hang_after=1)
    async with pipeline_of(tokenizer, engine, lim) as pipeline:
        task = asyncio.create_task(collect(pipeline, request()))
        await engine.waiting.wait()  # one token out, the next one slow
        task.cancel()  # the client left (a front cancels the call's task)
        with pytest.raises(asyncio.CancelledError):
            await task
        prompt = len(engine.jobs[0].prompt_token_ids)
        assert engine.closed == 1  # the engine call was cancelled
        assert await totals(lim) == (6000 - prompt - 1, 0, prompt, 1)
        assert len(lim.settles) == 1
        event = cast(Usage, pipeline.usage).events[0]
        assert (event.status, event.prompt_tokens, event.completion_tokens) == (
            "CANCELLED",
            prompt,
            1,
        )


async def test_a_stream_closed_from_outside_settles_before_the_close_returns(
    tokenizer: TextTokenizer,
) -> None:
    """A front that closes the stream (aclose) instead of cancelling its task: the engine
    call is cancelled, the request settled and its usage recorded by the time the close
    returns, not later when the garbage collector finalizes the inner stream."""
    lim, engine = limiter(), FakeDispatcher()
    async with pipeline_of(tokenizer, engine, lim) as pipeline:
        stream = pipeline.generate(request(), CallContext(tenant=TENANT))
        first = await anext(stream)
        assert first.token_ids
        await stream.aclose()
        prompt = len(engine.jobs[0].prompt_token_ids)
        assert engine.closed == 1
        assert len(lim.settles) == 1
        assert await totals(lim) == (6000 - prompt - 1, 0, prompt, 1)
        event = cast(Usage, pipeline.usage).events[0]
        assert (event.status, event.prompt_tokens, event.completion_tokens) == (
            "CANCELLED",
            prompt,
            1,
        )


@pytest.mark.parametrize("fail_after", [0, 2])
async def test_an_engine_failure_charges_only_what_an_engine_answered(
    tokenizer: TextTokenizer, fail_after: int
) -> None:
    lim, engine = limiter(), FakeDispatcher(fail_after=fail_after)
    async with pipeline_of(tokenizer, engine, lim) as pipeline:
        with pytest.raises(GatewayError) as info:
            await collect(pipeline, request())
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
        prompt = len(engine.jobs[0].prompt_token_ids) if fail_after else 0
        assert await totals(lim) == (6000 - prompt - fail_after, 0, prompt, fail_after)
        assert len(lim.settles) == 1


async def test_an_engine_refusal_charges_nothing(tokenizer: TextTokenizer) -> None:
    full = GatewayError(grpc.StatusCode.RESOURCE_EXHAUSTED, "full", retry_after_ms=300)
    lim, engine = limiter(), FakeDispatcher(refuse=full)
    async with pipeline_of(tokenizer, engine, lim) as pipeline:
        with pytest.raises(GatewayError) as info:
            await collect(pipeline, request())
        assert info.value is full
        assert await totals(lim) == (6000, 0, 0, 0)
        assert len(lim.settles) == 1


async def test_a_refused_overlapped_admission_sends_nothing_and_charges_nothing(
    tokenizer: TextTokenizer,
) -> None:
    lim, engine = limiter(), FakeDispatcher()
    async with pipeline_of(tokenizer, engine, lim) as pipeline:
        await collect(pipeline, request())  # the tenant's levels are known here now
        other = RateLimiter(lim.store)  # another replica spends the tokens meanwhile
        assert (await other.reserve(TENANT, int((await totals(lim))[0]) - 5)).allowed
        before = await totals(lim)
        stream = pipeline.generate(request(), CallContext(tenant=TENANT))
        with pytest.raises(GatewayError) as info:
            await anext(stream)  # the engine had started; nothing of it reaches the client
        assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert len(engine.jobs) == 2
        assert engine.closed == 1
        assert await totals(lim) == before
        assert len(lim.settles) == 1  # the first request's: the refused one held nothing


async def test_a_store_failure_in_the_overlapped_admission_fails_closed_and_holds_nothing(
    tokenizer: TextTokenizer,
) -> None:
    lim, engine = limiter(fail_mode="closed"), FakeDispatcher()
    async with pipeline_of(tokenizer, engine, lim) as pipeline:
        await collect(pipeline, request())
        before = await totals(lim)
        cast(FlakyStore, lim.store).down = True
        with pytest.raises(GatewayError) as info:
            await collect(pipeline, request())
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
        cast(FlakyStore, lim.store).down = False
        assert await totals(lim) == before
        assert len(lim.settles) == 1


async def test_a_client_gone_during_the_overlapped_admission_leaves_nothing_held(
    tokenizer: TextTokenizer,
) -> None:
    lim, engine = limiter(), FakeDispatcher(hang_after=0)  # the prefill never ends
    async with pipeline_of(tokenizer, engine, lim) as pipeline:
        first = asyncio.create_task(collect(pipeline, request()))
        await engine.waiting.wait()  # two-call path: held from before the prompt
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        engine.waiting.clear()
        second = asyncio.create_task(collect(pipeline, request()))
        await engine.waiting.wait()  # overlapped: its reservation follows the engine call
        for _ in range(5):
            await asyncio.sleep(0)
        assert (await totals(lim))[1] == 1  # the overlapped reservation holds its lease
        second.cancel()
        with pytest.raises(asyncio.CancelledError):
            await second
        prompt = len(engine.jobs[0].prompt_token_ids)
        # sent to an engine, then the client left: each pays its prompt, nothing else
        assert await totals(lim) == (6000 - 2 * prompt, 0, 2 * prompt, 0)
        assert len(lim.settles) == 2
        assert engine.closed == 2
        assert pipeline.num_in_flight == 0


async def test_a_draining_pipeline_refuses_new_requests_and_waits_for_none(
    tokenizer: TextTokenizer,
) -> None:
    lim, engine = limiter(), FakeDispatcher()
    async with pipeline_of(tokenizer, engine, lim) as pipeline:
        await pipeline.drain(0.1)
        with pytest.raises(GatewayError) as info:
            await collect(pipeline, request())
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
        assert engine.jobs == []
        assert lim.settles == []


async def test_an_unknown_model_is_not_found_naming_the_known_ones(
    tokenizer: TextTokenizer,
) -> None:
    lim, engine = limiter(), FakeDispatcher()
    async with pipeline_of(tokenizer, engine, lim) as pipeline:
        req = request()
        req.model = "nope"
        with pytest.raises(GatewayError) as info:
            await collect(pipeline, req)
        assert info.value.code == grpc.StatusCode.NOT_FOUND
        assert "available: m" in info.value.message
        assert await totals(lim) == (6000, 0, 0, 0)  # refused before any admission


async def test_a_model_outside_the_tenants_list_is_denied_whether_or_not_it_exists(
    tokenizer: TextTokenizer,
) -> None:
    """No oracle of which models exist: a name outside the tenant's list is
    PERMISSION_DENIED naming only the tenant's models, served or not."""
    lim, engine = limiter(), FakeDispatcher()
    tenant = dataclasses.replace(TENANT, allowed_models=("other",))
    async with pipeline_of(tokenizer, engine, lim) as pipeline:
        messages = []
        for name in ("m", "nope"):
            req = request()
            req.model = name
            with pytest.raises(GatewayError) as info:
                await collect_as(pipeline, req, tenant)
            assert info.value.code == grpc.StatusCode.PERMISSION_DENIED
            assert "allowed: other" in info.value.message
            messages.append(info.value.message.replace(repr(name), "NAME"))
        assert messages[0] == messages[1]
        assert engine.jobs == []
