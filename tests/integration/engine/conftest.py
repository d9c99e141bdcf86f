"""Fixtures of the engine suites: one channel to the session engine, its llm.v1 stub,
and the model's tokenizer (a module that needs another channel defines its own)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from common.procs import ManagedProcess
from llm.v1 import engine_pb2_grpc
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
