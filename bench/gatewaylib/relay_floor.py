"""The transport floor of any gRPC gateway here: ``python -m bench.gatewaylib.relay_floor``.

A bare ``llm.v1.Gateway/Generate`` relay in front of one engine, built the way
every service of the stack is (``common.server.run_service``: grpc.aio on uvloop
where installed, the shared interceptors, health) and doing only what a proxy
cannot skip: accept the call, make one ``Engine/Generate`` call with the prompt's
token ids, send headers with the first chunk, and write every engine chunk back
as it arrives. No authentication, limits, tokenizing on the request path (each
distinct prompt is encoded once and remembered), routing, detokenization,
retries or settling.

With ``--engine-protocol vllm`` the engine is a stock VllmEngine server (smg-grpc-proto,
``vllm serve --grpc``): the relay then makes the engine side's own ``Generate``
(``bench.gatewaylib.sides.vllm_request``) and writes back each stream chunk's tokens,
so over a stock engine too ``floor - engine`` is the one grpc.aio hop, beside SMG's.

With ``--work`` it also does, per request, the work SMG does in front of the same
engine in this bench and that any gateway of this design cannot skip: it encodes every
prompt afresh (nothing remembered) and detokenizes every chunk into the response's
text, with the gateway's own tokenizer and incremental detokenizer. The ``work`` side
(``floor-work`` process) is that relay: ``work - floor`` is what the unskippable work
costs in this runtime, and ``work`` beside ``smg`` says whether a gateway written in
Python on grpc.aio could reach SMG's figure before doing anything else a gateway does
(authentication, limits, routing, retries).

``bench.gateway_bench`` runs it as the ``floor`` side beside the engine and the
gateway: ``floor - engine`` is what one more grpc.aio hop costs on this machine
(the part of the gateway's added latency no gateway logic can remove), and
``gateway - floor`` is the gateway's own work on the request path. It is a
benchmark device, never a serving mode: it trusts every caller.
"""

from __future__ import annotations

import argparse
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vllm_grpc  # type: ignore[import-untyped]

from bench.gatewaylib.sides import vllm_chunks, vllm_request
from common.config import ServiceConfig, add_service_args, default_model_dir, service_overrides
from common.log import configure_logging
from common.server import Context, ServiceHooks, run, run_service
from common.service_auth import read_service_token, token_metadata
from gateway.fleet.engine_client.base import CHANNEL_OPTIONS
from llm.v1 import common_pb2, engine_pb2, engine_pb2_grpc, gateway_pb2, gateway_pb2_grpc
from tokenizer_svc.tokenizer import TextTokenizer

UNSPECIFIED = common_pb2.FINISH_REASON_UNSPECIFIED
MAX_REMEMBERED_PROMPTS = 64  # the bench sends one prompt; a bound keeps memory flat anyway


class RelayFloor(gateway_pb2_grpc.GatewayServicer):
    """Gateway.Generate as a bare relay to one engine.

    Args:
        engine: The engine's stub (its channel is the caller's): ``llm.v1.Engine``'s, or
            VllmEngine's when ``protocol`` is ``vllm``.
        tokenizer: Encodes a prompt the first time it is seen.
        call_metadata: Sent on every engine call beside ``x-request-id``.
        protocol: ``llm`` or ``vllm``.
        work: Encode every prompt afresh and detokenize every chunk (``--work``).
    """

    def __init__(
        self,
        engine: Any,
        tokenizer: TextTokenizer,
        call_metadata: tuple[tuple[str, str], ...] = (),
        protocol: str = "llm",
        work: bool = False,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.call_metadata = call_metadata  # the service token, as the gateway sends it
        self.protocol = protocol
        self.work = work
        self._ids: dict[str, list[int]] = {}

    def prompt_ids(self, prompt: str) -> list[int]:
        """The prompt's token ids: encoded once per distinct prompt, or every time
        under ``work``."""
        if self.work:
            return self.tokenizer.encode(prompt)
        ids = self._ids.get(prompt)
        if ids is None:
            ids = self.tokenizer.encode(prompt)
            if len(self._ids) >= MAX_REMEMBERED_PROMPTS:
                self._ids.clear()
            self._ids[prompt] = ids
        return ids

    async def Generate(  # type: ignore[override]  # streams with context.write
        self, request: gateway_pb2.GenerateRequest, context: Context
    ) -> None:
        """Relay one engine stream; an engine error ends the call with the engine's status."""
        if not request.prompt:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the floor relays prompts only")
        request_id = request.request_id or uuid.uuid4().hex
        ids, max_tokens = self.prompt_ids(request.prompt), request.sampling.max_tokens
        if self.protocol == "vllm":  # greedy, ignore_eos: the engine side's request
            wire: Any = vllm_request(ids, max_tokens)
        else:
            sampling = engine_pb2.EngineSamplingParams(
                max_tokens=max_tokens, ignore_eos=request.sampling.ignore_eos
            )
            wire = engine_pb2.EngineGenerateRequest(
                request_id=request_id, prompt_token_ids=ids, sampling=sampling
            )
        call = self.engine.Generate(
            wire,
            timeout=context.time_remaining(),
            metadata=(("x-request-id", request_id), *self.call_metadata),
        )
        chunks: AsyncIterator[Any] = vllm_chunks(call) if self.protocol == "vllm" else call
        sent_headers = False
        detok = self.tokenizer.detokenizer() if self.work else None
        try:
            async for resp in chunks:
                if not sent_headers:  # as the gateway's front: headers with the first chunk
                    await context.send_initial_metadata((("x-request-id", request_id),))
                    sent_headers = True
                # a VllmEngine chunk has none
                finish = getattr(resp, "finish_reason", UNSPECIFIED)
                text = ""
                if detok is not None:
                    text = detok.add(resp.token_ids) + (detok.finish() if finish else "")
                await context.write(
                    gateway_pb2.GenerateResponse(
                        request_id=request_id,
                        text=text,
                        token_ids=resp.token_ids,
                        finish_reason=finish,
                    )
                )
        except grpc.aio.AioRpcError as e:
            await context.abort(e.code(), e.details() or "")
        finally:
            if not call.done():  # the client left: the engine frees the request at once
                call.cancel()

    async def ListModels(
        self, request: gateway_pb2.ListModelsRequest, context: Context
    ) -> gateway_pb2.ListModelsResponse:
        """The floor keeps no catalog."""
        return gateway_pb2.ListModelsResponse()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.gatewaylib.relay_floor")
    add_service_args(parser)
    parser.add_argument("--engine", required=True, help="the engine's host:port")
    parser.add_argument("--model-dir", help="the tokenizer's model directory")
    parser.add_argument(
        "--engine-protocol",
        choices=["llm", "vllm"],
        default="llm",
        help="llm.v1.Engine (ours), or VllmEngine (a stock vLLM gRPC server)",
    )
    parser.add_argument(
        "--work",
        action="store_true",
        help="encode every prompt and detokenize every chunk (what SMG does per request)",
    )
    args = parser.parse_args(argv)
    cfg = ServiceConfig(**{k: v for k, v in service_overrides(args).items() if v is not None})
    configure_logging("relay-floor", cfg.log_level, cfg.log_format)
    tokenizer = TextTokenizer(args.model_dir or default_model_dir())

    def register(server: grpc.aio.Server) -> list[str]:
        channel = grpc.aio.insecure_channel(args.engine, options=CHANNEL_OPTIONS)
        token = token_metadata(read_service_token(cfg.service_token_file))
        vllm = args.engine_protocol == "vllm"
        stub = vllm_grpc.VllmEngineStub(channel) if vllm else engine_pb2_grpc.EngineStub(channel)
        floor = RelayFloor(stub, tokenizer, token, args.engine_protocol, args.work)
        gateway_pb2_grpc.add_GatewayServicer_to_server(floor, server)
        return [gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name]

    run(run_service("relay-floor", cfg, ServiceHooks(register=register)))


if __name__ == "__main__":
    main()
