"""A model route falls back to its next target when the first is at capacity.

Two real engines serve the same weights under two names: ``fb-small`` with room for
two requests (one running, one waiting), and the session's engine under the default
name. The route ``fb-chat`` sends requests to ``fb-small``, then the default model.
With ``fb-small`` full, a request to the route is served by the default model instead
of being refused or queued behind the flood.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from common.config import DEFAULT_MODEL_NAME
from common.procs import ManagedProcess
from common.redis_server import RedisServer
from llm.v1 import admin_pb2, admin_pb2_grpc
from tests.conftest import engine_running
from tests.integration.gateway.conftest import GatewayProcess, chat, start_gateway
from tests.integration.gateway.test_gw_faults import engine_stats, wait_until

pytestmark = pytest.mark.integration
DEFAULT = DEFAULT_MODEL_NAME  # what the session's engine serves


@pytest.fixture(scope="module")
def fb_engines(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory, engine_server: ManagedProcess
) -> Iterator[tuple[ManagedProcess, ManagedProcess]]:
    small_env = {
        "LLM_ENGINE_MODEL_NAME": "fb-small",
        "LLM_ENGINE_CORE_SCHEDULER_MAX_NUM_SEQS": "1",
        "LLM_ENGINE_CORE_SCHEDULER_MAX_WAITING": "1",
    }
    logs = tmp_path_factory.mktemp("fb-engines")
    with engine_running("fb-small", model_dir, logs, env=small_env) as small:
        yield small, engine_server


@pytest.fixture(scope="module")
def fb_gateway(
    fb_engines: tuple[ManagedProcess, ManagedProcess],
    tokenizer_server: ManagedProcess,
    gw_redis: RedisServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[GatewayProcess]:
    gw = start_gateway(
        "gw-fb",
        [p.address for p in fb_engines],
        tokenizer_server.address,
        gw_redis.url,
        tmp_path_factory.mktemp("gw-fb"),
        {"LLM_RATELIMIT_KEY_PREFIX": f"fb-{secrets.token_hex(3)}:"},
    )
    try:
        yield gw
    finally:
        gw.stop()


def auth(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


def test_a_full_first_target_sends_the_request_to_the_next(
    fb_gateway: GatewayProcess, fb_engines: tuple[ManagedProcess, ManagedProcess]
) -> None:
    gw, small = fb_gateway, fb_engines[0]
    routing = admin_pb2_grpc.RoutingAdminStub(gw.channel)
    route = admin_pb2.ModelRoute(
        name="fb-chat",
        targets=[admin_pb2.RouteTarget(model="fb-small"), admin_pb2.RouteTarget(model=DEFAULT)],
    )
    routing.SetModelRoute(route, metadata=gw.admin_md)
    _, key = gw.tenant()
    # with room, the first target serves
    req = chat("Hi", max_tokens=2)
    req.model = "fb-chat"
    assert gw.generate(key, req)[0].model == "fb-small"
    # fill fb-small: one request running, one waiting
    long = chat("Tell me a very long story about the sea.", max_tokens=64)
    long.model = "fb-small"
    long.sampling.ignore_eos = True
    blockers: list[Any] = [
        gw.stub.Generate(long, metadata=auth(key), timeout=120) for _ in range(2)
    ]
    try:
        next(iter(blockers[0]))  # running on fb-small now

        def full() -> bool:  # the second one waits behind it
            stats = engine_stats(small.address)
            return stats.num_running + stats.num_waiting == 2

        wait_until(full)
        before = gw.metric("gateway_model_fallbacks_total", reason="capacity")
        chunks = gw.generate(key, req)
        assert chunks[0].model == DEFAULT
        assert chunks[-1].usage.completion_tokens == 2
        assert gw.metric("gateway_model_fallbacks_total", reason="capacity") == before + 1
    finally:
        for call in blockers:
            call.cancel()  # type: ignore[no-untyped-call]
        routing.DeleteModelRoute(
            admin_pb2.DeleteModelRouteRequest(name="fb-chat"), metadata=gw.admin_md
        )
