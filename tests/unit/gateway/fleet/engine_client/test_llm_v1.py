"""The llm.v1 client: our protocol as it is, with the service token added to each call
(the rest of its behaviour is covered through the replica, dispatcher and tokenizer
tests, which run over it)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from gateway.fleet.engine_client.llm_v1 import LlmV1Client
from llm.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from tests.unit.gateway.fleet.engine_client.scripted import start


class Echo(engine_pb2_grpc.EngineServicer):
    def __init__(self) -> None:
        self.metadata: list[dict[str, str]] = []

    async def Generate(self, request: Any, context: Any) -> AsyncIterator[Any]:
        self.metadata.append({k: str(v) for k, v in context.invocation_metadata()})
        yield engine_pb2.EngineGenerateResponse(
            request_id=request.request_id,
            token_ids=request.resumed_output_token_ids,  # carried as is
            finish_reason=common_pb2.LENGTH,
        )


async def test_requests_go_as_they_are_with_the_service_token() -> None:
    servicer = Echo()  # type: ignore[abstract]  # Generate is all it needs
    server, address = await start(engine_pb2_grpc.add_EngineServicer_to_server, servicer)
    client = LlmV1Client(address, "k" * 32)
    try:
        req = engine_pb2.EngineGenerateRequest(request_id="r9", resumed_output_token_ids=[4, 5])
        call = client.generate(req, timeout=10, metadata=(("x-request-id", "r9"),))
        out = [r async for r in call]
        assert call.done()
    finally:
        await client.close()
        await server.stop(0)
    assert [list(r.token_ids) for r in out] == [[4, 5]]
    assert servicer.metadata[0]["x-service-token"] == "k" * 32
    assert servicer.metadata[0]["x-request-id"] == "r9"
