"""One streamed call against a target, timed at the client.

Targets: an engine (``llm.v1.Engine/Generate``, token ids in, no auth) or a
Gateway API endpoint (``llm.v1.Gateway/Generate`` with ``authorization:
Bearer <key>``), which is the gateway itself or Envoy in front of it.
Every request is greedy with ``ignore_eos`` so it yields exactly
``max_tokens`` tokens, as serving benchmarks do to make output length a
controlled variable.

Timing (``time.perf_counter`` at the client, seconds):
    ttft  send -> first chunk carrying token ids
    itl   gaps between later chunks carrying token ids
    e2e   send -> end of stream (or the error)
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

import grpc

from bench.loadlib.workload import RequestSpec
from common.service_auth import token_metadata
from llm.v1 import (
    common_pb2,
    engine_pb2,
    engine_pb2_grpc,
    gateway_pb2,
    gateway_pb2_grpc,
)

# what a target yields per chunk: (new token ids, prompt tokens or 0, model version or "")
Progress = tuple[int, int, str]

OK = "OK"
CLIENT_CANCELLED = "CLIENT_CANCELLED"  # the run's drain timeout cut the stream


@dataclass(slots=True)
class RequestRecord:
    """What the client saw of one request."""

    tenant: str
    priority: int
    kind: str
    start: float  # seconds since the run started
    max_tokens: int
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    ttft: float | None = None
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    status: str = OK
    error: str = ""
    version: str = ""  # the model version that served it (gateway targets; first chunk)

    @property
    def ok(self) -> bool:
        """Finished without an error status."""
        return self.status == OK

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (None with < 2 tokens)."""
        if self.ttft is None or self.num_output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.num_output_tokens - 1)


class Target(Protocol):
    """Something that streams a generation for a request spec."""

    name: str

    def stream(self, spec: RequestSpec, timeout_s: float) -> AsyncIterator[Progress]:
        """Yields (new token ids in this chunk, prompt tokens if known else 0, model version
        if the target says which one served the request, else "")."""
        ...

    async def close(self) -> None:
        """Close channels."""
        ...


class EngineTarget:
    """``llm.v1.Engine`` at ``address``: token ids in, tenant and priority set per request."""

    name = "engine"

    def __init__(self, address: str, service_token: str = "") -> None:
        self.channel = grpc.aio.insecure_channel(address)
        self.stub = engine_pb2_grpc.EngineStub(self.channel)
        self.metadata = token_metadata(service_token)

    async def stream(self, spec: RequestSpec, timeout_s: float) -> AsyncIterator[Progress]:
        """See ``Target.stream``."""
        req = engine_pb2.EngineGenerateRequest(
            request_id=f"load-{spec.tenant}-{spec.index}",
            prompt_token_ids=spec.prompt_ids,
            sampling=engine_pb2.EngineSamplingParams(max_tokens=spec.max_tokens, ignore_eos=True),
            priority=common_pb2.Priority.ValueType(spec.priority),
            tenant_id=spec.tenant,
        )
        async for chunk in self.stub.Generate(req, timeout=timeout_s, metadata=self.metadata):
            yield len(chunk.token_ids), len(spec.prompt_ids), ""

    async def close(self) -> None:
        """See ``Target.close``."""
        await self.channel.close(None)


class GatewayTarget:
    """``llm.v1.Gateway`` at ``address`` (the gateway or Envoy); one API key per tenant.
    With ``ca_cert`` (PEM) over TLS, trusting that CA (Envoy's listener); else plaintext."""

    def __init__(
        self,
        address: str,
        keys: dict[str, str],
        name: str = "gateway",
        ca_cert: bytes | None = None,
    ) -> None:
        self.name = name
        self.keys = keys
        self.channel = (
            grpc.aio.secure_channel(address, grpc.ssl_channel_credentials(ca_cert))
            if ca_cert
            else grpc.aio.insecure_channel(address)
        )
        self.stub = gateway_pb2_grpc.GatewayStub(self.channel)

    async def stream(self, spec: RequestSpec, timeout_s: float) -> AsyncIterator[Progress]:
        """See ``Target.stream``."""
        msgs = common_pb2.ChatMessages(
            messages=[common_pb2.ChatMessage(role="user", content=spec.text)]
        )
        req = gateway_pb2.GenerateRequest(
            messages=msgs,
            request_id=f"load-{spec.tenant}-{spec.index}",
            sampling=common_pb2.SamplingParams(max_tokens=spec.max_tokens, ignore_eos=True),
        )
        md = (("authorization", f"Bearer {self.keys.get(spec.tenant, '')}"),)
        async for chunk in self.stub.Generate(req, metadata=md, timeout=timeout_s):
            yield len(chunk.token_ids), chunk.usage.prompt_tokens, chunk.model_version

    async def plain_round_trip(self, tenant: str, timeout_s: float = 10.0) -> None:
        """One authenticated call that does no other work (ListModels): the baseline a
        rejection's cost is measured against."""
        md = (("authorization", f"Bearer {self.keys.get(tenant, '')}"),)
        await self.stub.ListModels(gateway_pb2.ListModelsRequest(), metadata=md, timeout=timeout_s)

    async def close(self) -> None:
        """See ``Target.close``."""
        await self.channel.close(None)


async def run_one(target: Target, spec: RequestSpec, t0: float, timeout_s: float) -> RequestRecord:
    """Send ``spec``, time every chunk, never raise (errors land in the record)."""
    start = time.perf_counter()
    rec = RequestRecord(spec.tenant, spec.priority, spec.kind, start - t0, spec.max_tokens)
    last = start
    try:
        async for num_new, num_prompt, version in target.stream(spec, timeout_s):
            rec.num_prompt_tokens = num_prompt or rec.num_prompt_tokens
            rec.version = version or rec.version
            if not num_new:
                continue
            now = time.perf_counter()
            if rec.ttft is None:
                rec.ttft = now - start
            else:
                rec.itl.append(now - last)
            last = now
            rec.num_output_tokens += num_new
    except grpc.aio.AioRpcError as e:
        rec.status, rec.error = e.code().name, (e.details() or "")[:200]
    except asyncio.CancelledError:
        rec.status = CLIENT_CANCELLED
    rec.e2e = time.perf_counter() - start
    return rec
