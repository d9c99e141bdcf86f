"""Prompt encoding for the pipeline (docs/architecture.md, request step 4).

By default in process, with the same code tokenizer_svc runs
(``tokenizer_svc.service.encode_request``: one place applies the chat
template) and the tokenizer of the model chosen for the request (fetched from
its engines, ``gateway.fleet.tokenizers``), so the hot path has no tokenizer
RPC; long inputs are encoded on a worker thread (the tokenizers library drops
the GIL), never on the event loop. With ``gateway.tokenize_in_process: false``
it calls tokenizer_svc instead (which serves one model);
its INVALID_ARGUMENT messages pass through to the caller unchanged, anything
else becomes UNAVAILABLE naming the tokenizer.
"""

from __future__ import annotations

import asyncio

import grpc

from common.service_auth import token_metadata
from gateway.domain import CallContext, Deadline, GatewayError
from llm.v1 import gateway_pb2, tokenizer_pb2, tokenizer_pb2_grpc
from tokenizer_svc.service import OFFLOAD_CHARS, encode_request, request_chars
from tokenizer_svc.tokenizer import TextTokenizer, TokenizerInputError
from tokenizer_svc.tool_prompt import tools_chars

# No token of the tokenizers this stack serves is longer than this many characters
# (SmolLM2's longest is 81: a run of '#'): a prompt above
# ``context * MAX_CHARS_PER_TOKEN`` characters cannot fit, whatever it says.
MAX_CHARS_PER_TOKEN = 128


def check_prompt_size(request: gateway_pb2.GenerateRequest, max_context_tokens: int) -> None:
    """Refuse a prompt that cannot fit ``max_context_tokens`` by its length alone.

    Raises:
        GatewayError: INVALID_ARGUMENT naming the sizes.
    """
    if request.WhichOneof("input") == "messages":
        msgs = request.messages.messages
        chars = sum(len(m.content) + len(m.role) for m in msgs)
        chars += sum(len(c.arguments) + len(c.name) for m in msgs for c in m.tool_calls)
        chars += tools_chars(request.tools)
    else:
        chars = len(request.prompt)
    limit = max_context_tokens * MAX_CHARS_PER_TOKEN
    if chars > limit:
        raise GatewayError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"the prompt has {chars} characters, more than the model's context "
            f"of {max_context_tokens} tokens can hold (at most {limit} "
            "characters); shorten it",
        )


class Encoder:
    """Encodes GenerateRequest inputs, in process or through tokenizer_svc.

    Args:
        address: ``host:port`` of tokenizer_svc.
        timeout_s: Budget of one Encode call (the request deadline may cut it shorter).
        service_token: tokenizer_svc's service token.
        in_process: Encode in process with the request's tokenizer (False = call
            tokenizer_svc).
    """

    def __init__(
        self,
        address: str,
        timeout_s: float = 10.0,
        service_token: str = "",
        in_process: bool = True,
    ) -> None:
        self.address = address
        self.in_process = in_process
        self._token_md = token_metadata(service_token)
        self.timeout_s = timeout_s
        self.channel = grpc.aio.insecure_channel(address)
        self.stub = tokenizer_pb2_grpc.TokenizerStub(self.channel)

    async def close(self) -> None:
        """Close the channel."""
        await self.channel.close(None)

    async def encode(
        self,
        request: gateway_pb2.GenerateRequest,
        call: CallContext,
        deadline: Deadline,
        tokenizer: TextTokenizer,
    ) -> list[int]:
        """Prompt token ids (the chat template applied for messages) by ``tokenizer``,
        the chosen model's. The pipeline refuses a prompt no context could hold
        (``check_prompt_size``) before this.

        Raises:
            GatewayError: INVALID_ARGUMENT (bad input), DEADLINE_EXCEEDED, UNAVAILABLE.
        """
        which = request.WhichOneof("input")
        if which == "prompt":
            req = tokenizer_pb2.EncodeRequest(text=request.prompt)
        elif which == "messages":
            if not request.messages.messages:
                raise GatewayError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "messages is empty: send at least one chat message",
                )
            req = tokenizer_pb2.EncodeRequest(messages=request.messages, tools=request.tools)
        else:
            raise GatewayError(
                grpc.StatusCode.INVALID_ARGUMENT, "set either `prompt` or `messages` in the request"
            )
        if self.in_process:
            return await self._encode_local(tokenizer, req)
        metadata = (
            ("x-request-id", call.request_id),
            ("traceparent", call.traceparent),
            *self._token_md,
        )
        timeout = min(self.timeout_s, deadline.remaining())
        try:
            resp = await self.stub.Encode(req, timeout=timeout, metadata=metadata)
        except grpc.aio.AioRpcError as e:
            raise self._error(e) from None
        return list(resp.token_ids)

    @staticmethod
    async def _encode_local(tok: TextTokenizer, req: tokenizer_pb2.EncodeRequest) -> list[int]:
        try:
            if request_chars(req) > OFFLOAD_CHARS:
                ids, _ = await asyncio.to_thread(encode_request, tok, req)
            else:
                ids, _ = encode_request(tok, req)
        except TokenizerInputError as e:
            raise GatewayError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        return ids

    def _error(self, e: grpc.aio.AioRpcError) -> GatewayError:
        code = e.code()
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            return GatewayError(code, e.details() or "invalid input")
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return GatewayError(code, "the deadline passed while encoding the prompt")
        return GatewayError(
            grpc.StatusCode.UNAVAILABLE,
            f"the tokenizer service at {self.address} is unavailable "
            f"({code.name}: {e.details()}); retry shortly",
        )
