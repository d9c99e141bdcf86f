"""The gateway over the standard engine protocols, against our own engine serving them.

The session's engine serves llm.v1.Engine, VllmEngine, TrtllmService and SglangScheduler
on one port; gateways here address it as ``vllm://``, ``trtllm://`` and ``sglang://``, so
the gateway's clients of the three protocols run over real gRPC against a real model,
KV events included. (A stock vLLM server behind the gateway: tests/integration/stock,
run by ``make test-vllm``.)
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import pytest

from common.procs import ManagedProcess
from common.redis_server import RedisServer
from llm.v1 import common_pb2
from tests.integration.gateway.conftest import (
    GatewayProcess,
    cancel_after_first_chunk,
    chat,
    start_gateway,
)
from tests.integration.gateway.test_gw_faults import engine_stats, wait_until

pytestmark = pytest.mark.integration


def auth(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


@pytest.fixture(scope="module", params=["vllm", "trtllm", "sglang"])
def gw_standard(
    request: pytest.FixtureRequest,
    engine_server: ManagedProcess,
    tokenizer_server: ManagedProcess,
    gw_redis: RedisServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[str, GatewayProcess]]:
    protocol = str(request.param)
    gw = start_gateway(
        f"gw-{protocol}",
        [f"{protocol}://{engine_server.address}"],
        tokenizer_server.address,
        gw_redis.url,
        tmp_path_factory.mktemp(f"gw-{protocol}"),
    )
    try:
        yield protocol, gw
    finally:
        gw.stop()


def test_streams_with_usage_over_the_protocol(gw_standard: tuple[str, GatewayProcess]) -> None:
    protocol, gw = gw_standard
    _, key = gw.tenant()
    req = chat("Count from one to ten.", max_tokens=12, temperature=0.0)
    req.sampling.ignore_eos = True
    chunks = gw.generate(key, req)
    ids = [t for c in chunks for t in c.token_ids]
    assert "".join(c.text for c in chunks).strip()
    assert chunks[-1].finish_reason == common_pb2.LENGTH
    assert chunks[-1].usage.completion_tokens == len(ids) == 12
    assert chunks[-1].usage.prompt_tokens > 5
    again = gw.generate(key, req)
    assert [t for c in again for t in c.token_ids] == ids  # greedy: the same tokens
    if protocol in ("vllm", "sglang"):
        # no cache salt on VllmEngine or SglangScheduler: cached counts never reach the tenant
        assert again[-1].usage.cached_prompt_tokens == 0


def test_stop_string_over_the_protocol(gw_standard: tuple[str, GatewayProcess]) -> None:
    _, gw = gw_standard
    _, key = gw.tenant()
    req = chat("Count from one to twenty in words.", max_tokens=24, temperature=0.0)
    req.sampling.ignore_eos = True
    full = "".join(c.text for c in gw.generate(key, req))
    words = full.split(" ")
    assert len(words) > 3, full
    stop = " " + words[2]
    req.sampling.stop.append(stop)
    chunks = gw.generate(key, req)
    assert chunks[-1].finish_reason == common_pb2.STOP
    assert "".join(c.text for c in chunks) == full[: full.index(stop)]


def test_cancels_free_every_kv_block(
    gw_standard: tuple[str, GatewayProcess], engine_server: ManagedProcess
) -> None:
    _, gw = gw_standard
    n = 6
    _, key = gw.tenant(max_concurrent=n)
    cancel_after_first_chunk(gw, key, n)

    def idle() -> bool:
        s = engine_stats(engine_server.address)
        return s.num_running == 0 and s.num_waiting == 0 and s.num_kv_blocks_used == 0

    wait_until(idle, timeout=60)
    again = [gw.stub.Generate(chat("hi", max_tokens=1), metadata=auth(key)) for _ in range(n)]
    for call in again:  # every concurrency lease came back
        assert list(call)[-1].finish_reason


def test_a_seed_the_protocol_cannot_carry_is_refused_naming_it(
    gw_standard: tuple[str, GatewayProcess],
) -> None:
    protocol, gw = gw_standard
    _, key = gw.tenant()
    req = chat("hi", max_tokens=2, temperature=0.7)
    req.sampling.seed = 2**40
    if protocol == "trtllm":  # TrtllmService's random_seed is 64-bit: carried
        assert gw.generate(key, req)[-1].finish_reason
        return
    with pytest.raises(grpc.RpcError) as err:
        gw.generate(key, req)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = err.value.details() or ""
    assert "seed" in details
    assert f"{protocol}://" in details  # VllmEngine's is an int32, SglangScheduler has none


LONG_PROMPT = (
    "You are a careful assistant. Read the following list of fruits and remember it: "
    "apple, banana, cherry, damson, elderberry, fig, grape, honeydew, kiwi, lemon, mango. "
    "Now answer in one word."
)


def test_kv_events_keep_a_prompt_on_the_replica_that_holds_its_prefix(
    engine_server: ManagedProcess,
    tokenizer_server: ManagedProcess,
    gw_redis: RedisServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Two replicas of one engine, over TrtllmService (salted per tenant: its cached
    counts reach the tenant) and VllmEngine (unsalted). The first request goes to the
    first, whose KV events then list the prompt's blocks under the tenant's salt; every
    repeat goes back there (cached tokens shown). Without the events both replicas are
    idle and equal, and the repeats alternate (as they do with ``prefix_weight`` 0)."""
    a = engine_server.address
    entries = [f"trtllm://{a}", f"vllm://{a}"]
    # the whole weight on the cache: the replica that just served can still read as
    # busier for a moment (its load figures trail its last request), which the
    # default 0.5 lets win now and then
    gw = start_gateway(
        "gw-prefix",
        entries,
        tokenizer_server.address,
        gw_redis.url,
        tmp_path_factory.mktemp("p"),
        env={"LLM_GATEWAY_PREFIX_WEIGHT": "1.0"},
    )
    try:
        wait_until(lambda: all(gw.metric("gateway_replica_healthy", replica=e) for e in entries))
        _, key = gw.tenant()
        req = chat(LONG_PROMPT, max_tokens=1, temperature=0.0)
        gw.generate(key, req)  # both idle, never picked: the first entry takes it
        time.sleep(1.5)  # its events reach the gateway (the engine sends them every 50 ms)
        cached = [gw.generate(key, req)[-1].usage.cached_prompt_tokens for _ in range(4)]
        assert all(c >= 16 for c in cached), cached
    finally:
        gw.stop()
