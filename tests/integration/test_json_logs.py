"""Every line the session's services wrote in production log mode (``--log-format json``:
the engine, its kernel build and model load included, and the tokenizer) is one JSON
object."""

from __future__ import annotations

import json

import grpc
import pytest

from common.procs import ManagedProcess
from llm.v1 import engine_pb2, engine_pb2_grpc, tokenizer_pb2, tokenizer_pb2_grpc

pytestmark = pytest.mark.integration


def non_json_lines(proc: ManagedProcess) -> list[str]:
    """The lines of the process's stdout+stderr log that are not a JSON object."""
    bad = []
    for line in proc.log_path.read_text(errors="backslashreplace").splitlines():
        try:
            ok = isinstance(json.loads(line), dict)
        except ValueError:
            ok = False
        if not ok:
            bad.append(line)
    return bad


def test_engine_log_is_json_lines(engine_server: ManagedProcess) -> None:
    with grpc.insecure_channel(engine_server.address) as ch:
        req = engine_pb2.EngineGenerateRequest(
            request_id="json-logs",
            prompt_token_ids=[1, 2, 3],
            sampling=engine_pb2.EngineSamplingParams(max_tokens=2),
        )
        list(engine_pb2_grpc.EngineStub(ch).Generate(req, timeout=120))
    text = engine_server.log_path.read_text()
    assert '"event": "request finished"' in text  # the log is the live one
    assert '"component": "engine_svc.' in text  # stdlib records of the model code
    assert not non_json_lines(engine_server)


def test_tokenizer_log_is_json_lines(tokenizer_server: ManagedProcess) -> None:
    with grpc.insecure_channel(tokenizer_server.address) as ch:
        tokenizer_pb2_grpc.TokenizerStub(ch).Encode(
            tokenizer_pb2.EncodeRequest(text="Hello"), timeout=30
        )
    assert tokenizer_server.log_path.read_text().strip()
    assert not non_json_lines(tokenizer_server)
