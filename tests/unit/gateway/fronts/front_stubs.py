"""A stand-in for the pipeline behind the real HTTP front: the key check answers one
tenant and records each call's context; generate answers one finished chunk."""

from __future__ import annotations

from collections.abc import AsyncIterator

from gateway.domain import CallContext, Chunk
from llm.v1 import common_pb2, gateway_pb2
from ratelimit.config import LimitPolicy, Tenant


class StubAuth:
    def __init__(self, tenant: Tenant) -> None:
        self.answer = tenant
        self.calls: list[CallContext] = []

    async def tenant(self, call: CallContext) -> Tenant:
        self.calls.append(call)
        return self.answer


class OneChunk:
    """The pipeline's face to the front."""

    def __init__(self, limits: LimitPolicy | None = None) -> None:
        self.auth = StubAuth(Tenant("slow", limits or LimitPolicy()))
        self.draining = False
        self.calls = 0

    async def generate(
        self, request: gateway_pb2.GenerateRequest, call: CallContext
    ) -> AsyncIterator[Chunk]:
        self.calls += 1
        yield Chunk(
            call.request_id,
            text="hi",
            token_ids=[1],
            finish_reason=common_pb2.STOP,
            usage=common_pb2.Usage(prompt_tokens=1, completion_tokens=1),
            model="m",
        )
