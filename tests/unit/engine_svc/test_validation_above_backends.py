"""The engine service validates a request once, before any backend sees it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest

from engine_svc.backends import base
from engine_svc.backends.base import GenerateInput
from engine_svc.backends.streaming import open_stream
from engine_svc.core import validation
from engine_svc.core.outputs import ModelInfo, RequestOutput
from engine_svc.core.sampling_params import SamplingParams
from engine_svc.service import EngineServicer
from engine_svc.stats import BackendStats
from llm.v1 import engine_pb2, engine_pb2_grpc


class RefusingBackend:
    """A Backend that fails the test if a request reaches it (stands for any backend:
    native, vLLM)."""

    name = "refusing"

    def __init__(self) -> None:
        self.reached: list[str] = []

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def generate(self, inp: object) -> AsyncIterator[RequestOutput]:
        self.reached.append(str(inp))
        raise AssertionError("an invalid request reached the backend")
        yield  # pragma: no cover

    async def abort(self, request_id: str) -> None: ...

    def stats(self) -> BackendStats:
        raise AssertionError("not needed to refuse a request")

    def model_info(self) -> ModelInfo:
        return ModelInfo(model="m", max_context_length=64, vocab_size=100)


BAD = [
    (
        {"prompt_token_ids": [1, 500], "sampling": engine_pb2.EngineSamplingParams(max_tokens=4)},
        "outside the vocabulary [0, 100)",
    ),
    (
        {
            "prompt_token_ids": [1],
            "resumed_output_token_ids": [2, 3],
            "sampling": engine_pb2.EngineSamplingParams(max_tokens=2),
        },
        "resumed output tokens",
    ),
    (
        {
            "prompt_token_ids": list(range(60)),
            "sampling": engine_pb2.EngineSamplingParams(max_tokens=10),
        },
        "lower max_tokens to 4",
    ),
    (
        {
            "prompt_token_ids": [1],
            "priority": 9,
            "sampling": engine_pb2.EngineSamplingParams(max_tokens=4),
        },
        "priority must be in [0, 3]",
    ),
    (
        {
            "prompt_token_ids": [1],
            "sampling": engine_pb2.EngineSamplingParams(max_tokens=4, top_p=1.5),
        },
        "top_p",
    ),
]


@pytest.mark.parametrize(("fields", "message"), BAD)
def test_invalid_requests_never_reach_a_backend(fields: dict[str, object], message: str) -> None:
    backend = RefusingBackend()

    async def main() -> tuple[grpc.StatusCode, str]:
        server = grpc.aio.server()
        engine_pb2_grpc.add_EngineServicer_to_server(
            EngineServicer(backend, model_name="m", version="v", config_hash="h", build="b"), server
        )
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = engine_pb2_grpc.EngineStub(ch)
                req = engine_pb2.EngineGenerateRequest(request_id="r1", **fields)  # type: ignore[arg-type]
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for _ in stub.Generate(req, timeout=10):
                        pass
                return err.value.code(), err.value.details() or ""
        finally:
            await server.stop(None)

    code, details = asyncio.run(main())
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert message in details
    assert backend.reached == []


def test_a_request_is_validated_once_on_its_way_to_an_adapter(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The service validates; the adapter's own check (for direct callers) is then free."""
    calls: list[str] = []
    real = validation.validate_request

    def counting(request_id: str, *args: object, **kwargs: object) -> None:
        calls.append(request_id)
        real(request_id, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(base, "validate_request", counting)
    info = ModelInfo(model="m", max_context_length=64, vocab_size=100)
    inp = GenerateInput("r1", [1, 2], SamplingParams(max_tokens=4))
    inp.validate(info)  # the engine service
    open_stream(inp, info, running=True, live=(), engine="x", max_num_seqs=1, max_waiting=1)
    assert calls == ["r1"]
    assert inp.validated
    bad = GenerateInput("r2", [1, 500], SamplingParams(max_tokens=4))
    for _ in range(2):  # a refused request is checked again, and refused again
        with pytest.raises(ValueError, match="outside the vocabulary"):
            bad.validate(info)
    assert not bad.validated
