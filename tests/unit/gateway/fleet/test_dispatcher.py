"""Dispatcher retries and failover against in-process scripted engines (real gRPC on port 0).

The real engine's behaviour under faults is covered by the integration
suite; here the engine side is scripted so every retry rule is exercised
exactly: which codes retry, on which replica, with what resumed tokens.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from common.breaker import BreakerPolicy
from gateway.domain import Deadline, GatewayError
from gateway.fleet.dispatcher import AttemptProgress, Dispatcher, EngineJob
from gateway.fleet.replica_pool import ReplicaPool
from gateway.fleet.retry import RetryBudget, RetryPolicy
from gateway.request.detokenize import TextStream
from llm.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from tokenizer_svc.tokenizer import TextTokenizer

TOKENS = [504, 3575, 282, 4649, 314, 7042]  # " The capital of France is Paris"


class ScriptedEngine(engine_pb2_grpc.EngineServicer):
    """mode: ok | unavailable | full | invalid | die:<k> (k tokens, then UNAVAILABLE)."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.requests: list[engine_pb2.EngineGenerateRequest] = []

    async def Generate(
        self, request: engine_pb2.EngineGenerateRequest, context: object
    ) -> AsyncIterator[engine_pb2.EngineGenerateResponse]:
        ctx: grpc.aio.ServicerContext[object, object] = context  # type: ignore[assignment]
        self.requests.append(request)
        if self.mode == "unavailable":
            await ctx.abort(grpc.StatusCode.UNAVAILABLE, "draining")
        if self.mode == "full":
            ctx.set_trailing_metadata((("retry-after-ms", "300"),))
            await ctx.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full")
        if self.mode == "invalid":
            await ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, "bad stop_token_ids")
        start = len(request.resumed_output_token_ids)
        stop = int(self.mode.split(":")[1]) if self.mode.startswith("die:") else len(TOKENS)
        for i in range(start, len(TOKENS)):
            if i >= stop:
                await ctx.abort(grpc.StatusCode.UNAVAILABLE, "replica died")
            resp = engine_pb2.EngineGenerateResponse(token_ids=[TOKENS[i]])
            if i == len(TOKENS) - 1:
                resp.finish_reason = common_pb2.LENGTH
            yield resp


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> TextTokenizer:
    return TextTokenizer(model_dir)


async def setup(
    modes: list[str],
    *,
    failover: bool = True,
    budget_min: int = 5,
    models: list[str] | None = None,
) -> tuple[Dispatcher, list[ScriptedEngine], list[grpc.aio.Server]]:
    engines, servers, addresses = [], [], []
    for mode in modes:
        engine = ScriptedEngine(mode)  # type: ignore[abstract]  # Generate is all it needs
        server = grpc.aio.server()
        engine_pb2_grpc.add_EngineServicer_to_server(engine, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        engines.append(engine)
        servers.append(server)
        addresses.append(f"127.0.0.1:{port}")
    pool = ReplicaPool(addresses, BreakerPolicy())
    for r, model in zip(pool.replicas, models or ["m"] * len(modes), strict=True):
        r.healthy = True
        r.info = engine_pb2.ModelInfo(model=model, version="v1", max_context_length=2048)
    dispatcher = Dispatcher(
        pool, RetryPolicy(3, 0.001, 0.002), RetryBudget(0.2, budget_min, 10.0), failover=failover
    )
    return dispatcher, engines, servers


def job(**fields: Any) -> EngineJob:
    base: dict[str, Any] = {
        "request_id": "r1",
        "traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01",
        "tenant_id": "t",
        "priority": common_pb2.NORMAL,
        "model": "m",
        "model_version": "",
        "prompt_token_ids": [1, 2, 3],
        "sampling": engine_pb2.EngineSamplingParams(max_tokens=len(TOKENS)),
        "deadline": Deadline(30),
        "stop_strings": [],
        "tenant_weight": 3.0,
    }
    return EngineJob(**{**base, **fields})


async def run(
    dispatcher: Dispatcher,
    servers: list[grpc.aio.Server],
    tokenizer: TextTokenizer,
    progress: AttemptProgress | None = None,
    the_job: EngineJob | None = None,
) -> tuple[list[int], str, TextStream]:
    text = TextStream("r1", tokenizer, [], 3)
    ids: list[int] = []
    out = ""
    try:
        async for chunk in dispatcher.run(the_job or job(), text, progress or AttemptProgress()):
            ids.extend(chunk.token_ids)
            out += chunk.text
    finally:
        await dispatcher.pool.close()
        for s in servers:
            await s.stop(0)
    return ids, out, text


async def test_retry_on_another_replica_before_the_first_token(tokenizer: TextTokenizer) -> None:
    dispatcher, engines, servers = await setup(["unavailable", "ok"])
    progress = AttemptProgress()
    ids, out, _ = await run(dispatcher, servers, tokenizer, progress)
    assert ids == TOKENS
    assert (progress.dispatched, progress.engine_answered) == (True, True)
    assert (progress.model, progress.model_version) == ("m", "v1")
    assert progress.attempt_started_at > 0
    assert out == tokenizer.decode(TOKENS)
    assert [len(e.requests) for e in engines] == [1, 1]
    assert dispatcher.budget.num_retries == 1
    sent = engines[1].requests[0]  # who it is for reaches the engine, on the retry too
    assert (sent.tenant_id, sent.tenant_weight) == ("t", 3.0)


async def test_the_on_dispatched_callback_runs_once_each_engine_call_is_made_and_before_its_send(
    tokenizer: TextTokenizer,
) -> None:
    """What waits for the engine call (the overlapped admission) is released as each
    call is made: before the engine has it (its send is queued behind the callback's
    caller) and never before the first call exists."""
    dispatcher, engines, servers = await setup(["unavailable", "ok"])
    seen: list[tuple[int, int, bool]] = []  # (engine 0's requests, engine 1's, dispatched)
    progress = AttemptProgress()
    text = TextStream("r1", tokenizer, [], 3)
    chunks = []
    try:
        async for chunk in dispatcher.run(
            job(),
            text,
            progress,
            lambda: seen.append(
                (len(engines[0].requests), len(engines[1].requests), progress.dispatched)
            ),
        ):
            assert seen  # released before any chunk
            chunks.append(chunk)
    finally:
        await dispatcher.pool.close()
        for s in servers:
            await s.stop(0)
    assert [t for c in chunks for t in c.token_ids] == TOKENS
    # each attempt's callback ran before that engine had the request, once it was sent
    assert seen == [(0, 0, True), (1, 0, True)]
    # the first chunk names the model and version of the replica that served it
    assert [(c.model, c.model_version) for c in chunks[:2]] == [("m", "v1"), ("", "")]
    assert progress.num_chunks == len(chunks)


async def test_every_replica_full_is_resource_exhausted_with_retry_after(
    tokenizer: TextTokenizer,
) -> None:
    dispatcher, engines, servers = await setup(["full", "full"])
    with pytest.raises(GatewayError) as info:
        await run(dispatcher, servers, tokenizer)
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert info.value.retry_after_ms == 300
    assert [len(e.requests) for e in engines] == [1, 1]  # never the same replica twice


async def test_invalid_argument_is_not_retried(tokenizer: TextTokenizer) -> None:
    dispatcher, engines, servers = await setup(["invalid", "ok"])
    progress = AttemptProgress()
    with pytest.raises(GatewayError) as info:
        await run(dispatcher, servers, tokenizer, progress)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert [len(e.requests) for e in engines] == [1, 0]
    # sent, never answered: a refusal charges no prompt
    assert (progress.dispatched, progress.engine_answered) == (True, False)


async def test_no_retry_when_the_budget_is_spent(tokenizer: TextTokenizer) -> None:
    dispatcher, engines, servers = await setup(["unavailable", "ok"], budget_min=0)
    with pytest.raises(GatewayError) as info:
        await run(dispatcher, servers, tokenizer)
    assert info.value.code == grpc.StatusCode.UNAVAILABLE
    assert "127.0.0.1" in info.value.message  # says which replica failed and how
    assert [len(e.requests) for e in engines] == [1, 0]


async def test_failover_resumes_with_the_tokens_already_sent(tokenizer: TextTokenizer) -> None:
    dispatcher, engines, servers = await setup(["die:2", "ok"])
    ids, out, text = await run(dispatcher, servers, tokenizer)
    assert ids == TOKENS  # nothing repeated, nothing lost
    assert out == tokenizer.decode(TOKENS)
    resumed = engines[1].requests[0]
    assert list(resumed.resumed_output_token_ids) == TOKENS[:2]
    assert list(resumed.prompt_token_ids) == [1, 2, 3]
    assert text.usage().completion_tokens == len(TOKENS)


async def test_failover_off_ends_with_unavailable(tokenizer: TextTokenizer) -> None:
    dispatcher, engines, servers = await setup(["die:2", "ok"], failover=False)
    with pytest.raises(GatewayError) as info:
        await run(dispatcher, servers, tokenizer)
    assert info.value.code == grpc.StatusCode.UNAVAILABLE
    assert "after 2 output tokens" in info.value.message
    assert "failover is off" in info.value.message
    assert [len(e.requests) for e in engines] == [1, 0]


@pytest.mark.parametrize("shard_full", [False, True])
async def test_a_tenant_goes_to_its_shard_and_spills_only_when_it_refuses(
    tokenizer: TextTokenizer, shard_full: bool
) -> None:
    dispatcher, engines, servers = await setup(["ok", "ok", "ok"])
    dispatcher.pool.tenant_shard_size = 1
    shard = dispatcher.pool.shard("m", "", "t")
    assert shard is not None
    home = next(i for i, r in enumerate(dispatcher.pool.replicas) if r.address in shard)
    if shard_full:
        engines[home].mode = "full"  # RESOURCE_EXHAUSTED: the retry leaves the shard
    ids, _, _ = await run(dispatcher, servers, tokenizer)
    assert ids == TOKENS
    served = [i for i, e in enumerate(engines) if e.requests and e.mode == "ok"]
    assert len(engines[home].requests) == 1
    assert len(served) == 1  # exactly one replica streamed it
    assert (served[0] != home) == shard_full


@pytest.mark.parametrize("mode", ["full", "unavailable"])
async def test_a_route_moves_to_its_next_target_when_the_first_refuses(
    tokenizer: TextTokenizer, mode: str
) -> None:
    """Every replica of the route's first target at capacity (or failing) before any
    token: the next target serves it, within the retry budget."""
    dispatcher, engines, servers = await setup([mode, mode, "ok"], models=["a", "a", "b"])
    progress = AttemptProgress()
    the_job = job(model="a", fallback_models=(("b", ""),))
    ids, _, _ = await run(dispatcher, servers, tokenizer, progress, the_job)
    assert ids == TOKENS
    assert [len(e.requests) for e in engines] == [1, 1, 1]  # both of a's, then b
    assert (progress.model, the_job.model) == ("b", "b")
    assert engines[2].requests[0].model == "b"


async def test_no_fallback_once_tokens_were_streamed(tokenizer: TextTokenizer) -> None:
    """A stream that broke after tokens continues only on its own model (failover);
    another model would continue someone else's text."""
    dispatcher, engines, servers = await setup(["die:2", "ok"], models=["a", "b"])
    the_job = job(model="a", fallback_models=(("b", ""),))
    with pytest.raises(GatewayError) as info:
        await run(dispatcher, servers, tokenizer, the_job=the_job)
    assert info.value.code == grpc.StatusCode.UNAVAILABLE
    assert [len(e.requests) for e in engines] == [1, 0]


async def test_no_fallback_past_the_retry_budget(tokenizer: TextTokenizer) -> None:
    dispatcher, engines, servers = await setup(["full", "ok"], models=["a", "b"], budget_min=0)
    the_job = job(model="a", fallback_models=(("b", ""),))
    with pytest.raises(GatewayError) as info:
        await run(dispatcher, servers, tokenizer, the_job=the_job)
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert [len(e.requests) for e in engines] == [1, 0]


async def test_invalid_argument_never_falls_back(tokenizer: TextTokenizer) -> None:
    dispatcher, engines, servers = await setup(["invalid", "ok"], models=["a", "b"])
    the_job = job(model="a", fallback_models=(("b", ""),))
    with pytest.raises(GatewayError) as info:
        await run(dispatcher, servers, tokenizer, the_job=the_job)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert [len(e.requests) for e in engines] == [1, 0]
