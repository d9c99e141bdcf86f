"""Fixtures of the engine suites: one channel to the session engine, its llm.v1 stub,
and the model's tokenizer (a module that needs another channel defines its own); and
``wait_for_idle``, the KV blocks the engine holds once nothing runs."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from common.procs import ManagedProcess
from llm.v1 import engine_pb2, engine_pb2_grpc
from tokenizer_svc.tokenizer import TextTokenizer


@pytest.fixture(scope="module")
def channel(engine_server: ManagedProcess) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(engine_server.address) as ch:
        yield ch


@pytest.fixture(scope="module")
def native(channel: grpc.Channel) -> engine_pb2_grpc.EngineStub:
    return engine_pb2_grpc.EngineStub(channel)


@pytest.fixture(scope="module")
def tok(model_dir: Path) -> TextTokenizer:
    return TextTokenizer(model_dir)


def wait_for_idle(native: engine_pb2_grpc.EngineStub, timeout: float = 30) -> int:
    """KV blocks in use once nothing runs or waits (the engine's own stats)."""
    deadline = time.monotonic() + timeout
    while True:
        s = native.GetStats(engine_pb2.GetStatsRequest())
        if (s.num_running == 0 and s.num_waiting == 0) or time.monotonic() > deadline:
            return int(s.num_kv_blocks_used)
        time.sleep(0.05)
