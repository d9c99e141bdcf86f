"""SubscribeKvEvents served by our engine (real model, real gRPC on loopback) over
VllmEngine and TrtllmService: the prefix cache's stored blocks with their tokens and
chain, the salt in the protocol's terms, load records, and a resume the engine cannot
serve answered with a cleared cache."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
from smg_grpc_proto.generated import (
    common_pb2,
    trtllm_service_pb2,
    trtllm_service_pb2_grpc,
    vllm_engine_pb2,
    vllm_engine_pb2_grpc,
)

pytestmark = pytest.mark.integration

BLOCK = 16  # the engine's KV block size (GetServerInfo says so; checked below)


def prompt(seed: int) -> list[int]:
    """A prompt no other test sends: three full blocks and a bit."""
    return [1, *(1000 + seed * 64 + i for i in range(3 * BLOCK + 3))]


class Subscription:
    """Batches of one SubscribeKvEvents call, read on a thread until cancelled."""

    def __init__(self, call: Any) -> None:
        self.call = call
        self.batches: list[common_pb2.KvEventBatch] = []
        self.error: grpc.RpcError | None = None
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for batch in self.call:
                self.batches.append(batch)
        except grpc.RpcError as e:
            self.error = e

    def wait_for(self, found: Callable[[], bool], timeout: float = 60) -> None:
        end = time.monotonic() + timeout
        while not found():
            assert self.error is None or self.error.code() == grpc.StatusCode.CANCELLED, self.error
            assert time.monotonic() < end, "the events never came"
            time.sleep(0.05)

    def stored(self) -> list[tuple[common_pb2.KvBlocksStored, int]]:
        """Every stored event's (event, the batch's sequence number)."""
        return [
            (e.stored, b.sequence_number)
            for b in list(self.batches)
            for e in b.events
            if e.WhichOneof("data") == "stored"
        ]

    def close(self) -> None:
        self.call.cancel()
        self._thread.join(timeout=10)


@pytest.fixture
def subscribe(channel: grpc.Channel) -> Iterator[Callable[..., Subscription]]:
    opened: list[Subscription] = []
    vllm = vllm_engine_pb2_grpc.VllmEngineStub(channel)
    trt = trtllm_service_pb2_grpc.TrtllmServiceStub(channel)

    def open_(protocol: str, **fields: object) -> Subscription:
        stub = vllm if protocol == "vllm" else trt
        req = common_pb2.SubscribeKvEventsRequest(**fields)  # type: ignore[arg-type]
        sub = Subscription(stub.SubscribeKvEvents(req, timeout=120))
        opened.append(sub)
        return sub

    yield open_
    for s in opened:
        s.close()


def chain_of(stored: list[common_pb2.KvBlocksStored], ids: list[int]) -> list[int]:
    """The engine hashes of ``ids``' full blocks, from the events, checking the chain."""
    by_tokens = {tuple(s.blocks[0].token_ids): s for s in stored}
    hashes: list[int] = []
    for i in range(len(ids) // BLOCK):
        s = by_tokens.get(tuple(ids[i * BLOCK : (i + 1) * BLOCK]))
        if s is None:
            break
        assert s.blocks[0].block_size == BLOCK
        if i == 0:
            assert not s.HasField("parent_block_hash")
        else:
            assert s.parent_block_hash == hashes[-1]
        hashes.append(s.blocks[0].block_hash)
    return hashes


def test_vllm_subscriber_sees_the_prompt_blocks_stored_in_chain_with_loads(
    channel: grpc.Channel, subscribe: Callable[..., Subscription]
) -> None:
    vllm = vllm_engine_pb2_grpc.VllmEngineStub(channel)
    assert vllm.GetServerInfo(vllm_engine_pb2.GetServerInfoRequest()).block_size == BLOCK
    sub = subscribe("vllm", load_records_before_first_batch=True)
    sub.wait_for(lambda: bool(sub.batches))
    first = sub.batches[0]
    assert first.load.load_only
    assert first.sequence_number == 0
    assert not first.events
    assert first.load.max_running_requests > 0
    ids = prompt(1)
    req = vllm_engine_pb2.GenerateRequest(
        request_id="kv-events-vllm",
        tokenized=vllm_engine_pb2.TokenizedInput(input_ids=ids),
        sampling_params=vllm_engine_pb2.SamplingParams(temperature=0.0, max_tokens=2),
        stream=True,
    )
    list(vllm.Generate(req, timeout=120))
    sub.wait_for(lambda: len(chain_of([s for s, _ in sub.stored()], ids)) == 3)
    mine = [s for s, _ in sub.stored() if next(iter(s.blocks[0].token_ids)) in ids]
    assert all(not s.cache_salt for s in mine)  # VllmEngine sends no salt
    assert all(s.tier == common_pb2.KV_CACHE_TIER_DEVICE for s in mine)
    numbered = [b.sequence_number for b in sub.batches if b.events]
    assert numbered == sorted(numbered)
    assert len(set(numbered)) == len(numbered)
    assert all(b.HasField("load") for b in sub.batches if b.events)


def test_trtllm_subscriber_sees_the_salt_as_its_cache_salt_id(
    channel: grpc.Channel, subscribe: Callable[..., Subscription]
) -> None:
    trt = trtllm_service_pb2_grpc.TrtllmServiceStub(channel)
    sub = subscribe("trtllm")
    ids = prompt(2)
    req = trtllm_service_pb2.GenerateRequest(
        request_id="kv-events-trt",
        tokenized=trtllm_service_pb2.TokenizedInput(input_token_ids=ids),
        sampling_config=trtllm_service_pb2.SamplingConfig(temperature=0.0),
        max_tokens=2,
        streaming=True,
        cache_salt_id=-42,
    )
    time.sleep(0.2)  # subscribed before the request is admitted
    list(trt.Generate(req, timeout=120))
    sub.wait_for(lambda: len(chain_of([s for s, _ in sub.stored()], ids)) == 3)
    roots = [
        s
        for s, _ in sub.stored()
        if list(s.blocks[0].token_ids) == ids[:BLOCK] and not s.HasField("parent_block_hash")
    ]
    assert roots
    assert roots[-1].cache_salt == "-42"


def test_a_resume_the_engine_cannot_serve_starts_with_a_cleared_cache(
    subscribe: Callable[..., Subscription],
) -> None:
    sub = subscribe("vllm", start_sequence_number=2**62)  # numbers it never gave
    sub.wait_for(lambda: any(b.events for b in sub.batches))
    first = next(b for b in sub.batches if b.events)
    assert first.events[0].WhichOneof("data") == "cleared"
