"""The engine job of a counted prompt: the route target it fits, max_tokens, the version
by routing policy, and the ids it carries (no router, or a scripted one; no server)."""

from __future__ import annotations

from typing import cast

import grpc
import pytest

from gateway.domain import CallContext, Deadline, GatewayError
from gateway.fleet.dispatcher import EngineJob
from gateway.release.model_routes import RouteTarget
from gateway.release.version_router import RouteDecision, VersionRouter
from gateway.request.job import JobBuilder
from gateway.request.models import Choice
from llm.v1 import common_pb2, engine_pb2, gateway_pb2
from tests.unit.gateway.request.fakes import TENANT


class Router:
    """A VersionRouter that answers one decision and keeps what it was asked."""

    def __init__(self, decision: RouteDecision) -> None:
        self.decision = decision
        self.asked: list[tuple[str, str, str, str]] = []

    async def decide(
        self, model: str, requested: str, tenant_id: str, session_key: str = ""
    ) -> RouteDecision:
        self.asked.append((model, requested, tenant_id, session_key))
        return self.decision


def choice(*contexts: int, version: str = "") -> Choice:
    """A route over models m0, m1, ... with these context lengths."""
    targets = tuple(RouteTarget(f"m{i}", version) for i in range(len(contexts)))
    infos = [
        engine_pb2.ModelInfo(model=t.model, max_context_length=n)
        for t, n in zip(targets, contexts, strict=True)
    ]
    return Choice("r", targets, list(zip(targets, infos, strict=True)))


def request(max_tokens: int = 0, stop: tuple[str, ...] = ()) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, stop=list(stop))
    )


async def build(
    builder: JobBuilder, req: gateway_pb2.GenerateRequest, ch: Choice, num_prompt: int
) -> tuple[EngineJob, str]:
    call = CallContext(request_id="corr-1", session_key="s1")
    return await builder.build(
        req, call, TENANT, ch, list(range(num_prompt)), Deadline(30), common_pb2.CRITICAL
    )


async def test_without_a_router_the_job_carries_the_request_and_the_default_max_tokens() -> None:
    builder = JobBuilder(None, default_max_tokens=16, max_max_tokens=0)
    call = CallContext(request_id="corr-1")
    job, shadow = await builder.build(
        request(stop=("\n",)),
        call,
        TENANT,
        choice(100),
        [1, 2, 3],
        Deadline(30),
        common_pb2.CRITICAL,
    )
    assert shadow == ""
    assert job.model == "m0"
    assert job.model_version == ""  # any version
    assert job.sampling.max_tokens == 16
    assert job.prompt_token_ids == [1, 2, 3]
    assert job.stop_strings == ["\n"]
    assert (job.correlation_id, job.tenant_id) == ("corr-1", "acme")
    assert job.traceparent == call.traceparent
    assert job.priority == common_pb2.CRITICAL
    assert job.request_id.startswith("acme")  # the engine id is the gateway's own
    assert "corr-1" not in job.request_id


async def test_the_default_max_tokens_is_capped_by_what_the_context_leaves() -> None:
    builder = JobBuilder(None, default_max_tokens=16, max_max_tokens=0)
    job, _ = await build(builder, request(), choice(100), 90)
    assert job.sampling.max_tokens == 10


async def test_a_prompt_too_long_for_the_first_target_moves_to_the_next() -> None:
    builder = JobBuilder(None, default_max_tokens=16, max_max_tokens=0)
    ch = choice(50, 500)
    job, _ = await build(builder, request(max_tokens=20), ch, 40)
    assert ch.index == 1
    assert job.model == "m1"


async def test_max_tokens_over_the_gateway_limit_is_an_invalid_argument() -> None:
    builder = JobBuilder(None, default_max_tokens=16, max_max_tokens=32)
    with pytest.raises(GatewayError) as info:
        await build(builder, request(max_tokens=64), choice(1000), 10)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "at most 32" in info.value.message


async def test_the_router_picks_the_version_fallbacks_and_shadow() -> None:
    router = Router(RouteDecision("v2", fallbacks=("v1",), reason="canary", shadow_version="v3"))
    builder = JobBuilder(cast(VersionRouter, router), default_max_tokens=16, max_max_tokens=0)
    job, shadow = await build(builder, request(), choice(100, version="v1"), 10)
    assert router.asked == [("m0", "v1", "acme", "s1")]
    assert (job.model_version, job.fallback_versions, shadow) == ("v2", ("v1",), "v3")
