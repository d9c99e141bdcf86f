"""The tokenizer_svc client of the pipeline (docs/architecture.md, request step 3).

Prompts and chat messages are encoded by tokenizer_svc (one place applies
the chat template); its INVALID_ARGUMENT messages pass through to the
caller unchanged, anything else becomes UNAVAILABLE naming the tokenizer.
"""

from __future__ import annotations

import grpc

from gateway.domain import CallContext, Deadline, GatewayError
from llm.v1 import gateway_pb2, tokenizer_pb2, tokenizer_pb2_grpc


class Encoder:
    """Encodes GenerateRequest inputs through tokenizer_svc.

    Args:
        address: ``host:port`` of tokenizer_svc.
        timeout_s: Budget of one Encode call (the request deadline may cut it shorter).
    """

    def __init__(self, address: str, timeout_s: float = 10.0) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.channel = grpc.aio.insecure_channel(address)
        self.stub = tokenizer_pb2_grpc.TokenizerStub(self.channel)

    async def close(self) -> None:
        """Close the channel."""
        await self.channel.close(None)

    async def encode(self, request: gateway_pb2.GenerateRequest, call: CallContext,
                     deadline: Deadline) -> list[int]:
        """Prompt token ids (the chat template applied for messages).

        Raises:
            GatewayError: INVALID_ARGUMENT (bad input), DEADLINE_EXCEEDED, UNAVAILABLE.
        """
        which = request.WhichOneof("input")
        if which == "prompt":
            req = tokenizer_pb2.EncodeRequest(text=request.prompt)
        elif which == "messages":
            if not request.messages.messages:
                raise GatewayError(grpc.StatusCode.INVALID_ARGUMENT,
                                   "messages is empty: send at least one chat message")
            req = tokenizer_pb2.EncodeRequest(messages=request.messages)
        else:
            raise GatewayError(grpc.StatusCode.INVALID_ARGUMENT,
                               "set either `prompt` or `messages` in the request")
        metadata = (("x-request-id", call.request_id), ("traceparent", call.traceparent))
        timeout = min(self.timeout_s, deadline.remaining())
        try:
            resp = await self.stub.Encode(req, timeout=timeout, metadata=metadata)
        except grpc.aio.AioRpcError as e:
            raise self._error(e) from None
        return list(resp.token_ids)

    def _error(self, e: grpc.aio.AioRpcError) -> GatewayError:
        code = e.code()
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            return GatewayError(code, e.details() or "invalid input")
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return GatewayError(code, "the deadline passed while encoding the prompt")
        return GatewayError(grpc.StatusCode.UNAVAILABLE,
                            f"the tokenizer service at {self.address} is unavailable "
                            f"({code.name}: {e.details()}); retry shortly")
