"""``llm.v1.Gateway``: a thin gRPC front over the pipeline.

It only converts: metadata -> ``CallContext``, ``Chunk`` -> GenerateResponse (tool
call deltas and the thought included: the pipeline shapes them for every front),
``GatewayError`` -> status + trailing metadata. Headers are sent with the
first chunk, never earlier, so a failure before the first token is a
trailers-only status that Envoy may retry on another gateway replica. The
tenant's ``x-ratelimit-*`` figures go with them (in the trailers of a refusal).
"""

from __future__ import annotations

import contextlib

import grpc

from common.log import get_logger
from common.server import Context, request_id_var
from gateway.domain import (
    SESSION_KEY_HEADER,
    CallContext,
    Chunk,
    GatewayError,
    session_key,
)
from gateway.fleet.replica_pool import ModelEntry
from gateway.fronts.forwarded import TrustedProxies
from gateway.request.pipeline import Pipeline
from llm.v1 import gateway_pb2, gateway_pb2_grpc

log = get_logger(__name__)
_NO_PROXIES = TrustedProxies()
SERVICE_NAME = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name


def call_context(
    request_id: str, context: Context, proxies: TrustedProxies | None = None
) -> CallContext:
    """The front-agnostic call context from gRPC metadata and deadline
    (``x-forwarded-for`` only from one of ``proxies``; none = trust no one)."""
    md: dict[str, str] = {}
    for key, value in context.invocation_metadata() or ():
        md[key] = value.decode() if isinstance(value, bytes) else value
    return CallContext(
        authorization=md.get("authorization", ""),
        request_id=request_id or md.get("x-request-id") or request_id_var.get(),
        traceparent=md.get("traceparent", ""),
        timeout_s=context.time_remaining(),
        session_key=session_key(md.get(SESSION_KEY_HEADER, "")),
        source=(proxies or _NO_PROXIES).source(md.get("x-forwarded-for", ""), context.peer() or ""),
    )


def chunk_to_proto(chunk: Chunk) -> gateway_pb2.GenerateResponse:
    """One Chunk as a GenerateResponse."""
    resp = gateway_pb2.GenerateResponse(
        request_id=chunk.request_id,
        text=chunk.text,
        token_ids=chunk.token_ids,
        logprobs=chunk.logprobs,
        finish_reason=chunk.finish_reason,  # type: ignore[arg-type]
        model=chunk.model,
        model_version=chunk.model_version,
        tool_calls=chunk.tool_calls,
        reasoning_text=chunk.reasoning_text,
        index=chunk.index,
    )
    if chunk.usage is not None:
        resp.usage.CopyFrom(chunk.usage)
    return resp


def models_to_proto(entries: list[ModelEntry]) -> gateway_pb2.ListModelsResponse:
    """The catalog as a ListModelsResponse.

    With a routing policy each version shows its weight (percent) and state
    (stable | canary | shadow | draining); without one, versions share the
    traffic by load and each shows an equal share as ``stable``.
    """
    cards = []
    for e in entries:
        share = 100 // max(1, len(e.versions))
        versions = [
            gateway_pb2.ModelVersion(
                version=v,
                weight=round(e.routes[v][0]) if v in e.routes else share,
                state=e.routes[v][1] if v in e.routes else "stable",
                num_replicas=n,
                num_healthy_replicas=h,
            )
            for v, (n, h) in sorted(e.versions.items())
        ]
        cards.append(
            gateway_pb2.ModelCard(
                id=e.model,
                max_context_length=e.max_context_length,
                versions=versions,
                owned_by="llm-serving-stack",
                route_targets=list(e.targets),
            )
        )
    return gateway_pb2.ListModelsResponse(models=cards)


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    """llm.v1.Gateway over one ``Pipeline``.

    Args:
        pipeline: The front-agnostic request pipeline.
        proxies: Whose ``x-forwarded-for`` names the client (None = no one's).
    """

    def __init__(self, pipeline: Pipeline, proxies: TrustedProxies | None = None) -> None:
        self.pipeline = pipeline
        self.proxies = proxies

    async def Generate(  # type: ignore[override]  # streams with context.write
        self, request: gateway_pb2.GenerateRequest, context: Context
    ) -> None:
        """Stream the completion (written with ``context.write``); errors become statuses."""
        call = call_context(request.request_id, context, self.proxies)
        sent_headers = False
        try:
            async with contextlib.aclosing(self.pipeline.generate(request, call)) as chunks:
                async for chunk in chunks:
                    if not sent_headers:
                        await context.send_initial_metadata(
                            (("x-request-id", call.request_id), *call.ratelimit.items())
                        )
                        sent_headers = True
                    await context.write(chunk_to_proto(chunk))
        except GatewayError as e:
            await self._abort(context, call, e)

    async def ListModels(
        self, request: gateway_pb2.ListModelsRequest, context: Context
    ) -> gateway_pb2.ListModelsResponse:
        """Models the caller may use, from the engines' ModelInfo."""
        call = call_context("", context, self.proxies)
        try:
            return models_to_proto(await self.pipeline.list_models(call))
        except GatewayError as e:
            await self._abort(context, call, e)
        raise AssertionError("unreachable")  # abort() always raises

    @staticmethod
    async def _abort(context: Context, call: CallContext, e: GatewayError) -> None:
        md = (*e.metadata(), ("x-request-id", call.request_id), *call.ratelimit.items())
        await context.abort(e.code, e.message, trailing_metadata=md)


def add_to_server(servicer: GatewayServicer, server: grpc.aio.Server) -> list[str]:
    """Mount the servicer; returns the full service name for health and reflection."""
    gateway_pb2_grpc.add_GatewayServicer_to_server(servicer, server)
    return [SERVICE_NAME]
