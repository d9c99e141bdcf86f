"""Thin grpc.aio servicer over TextTokenizer: parse, call, map errors."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import grpc
from prometheus_client import Counter, Histogram

from common.log import get_logger
from common.server import Context
from llm.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from tokenizer_svc.tokenizer import TextTokenizer, TokenizerInputError
from tokenizer_svc.tool_prompt import chat_input, tools_chars

log = get_logger(__name__)

REQUESTS = Counter(
    "tokenizer_requests_total", "Tokenizer RPCs by method and gRPC status", ["method", "code"]
)
LATENCY = Histogram(
    "tokenizer_request_seconds",
    "Tokenizer RPC latency",
    ["method"],
    buckets=(1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 1),
)
TOKENS = Counter("tokenizer_tokens_total", "Tokens produced or consumed", ["direction"])

# Texts longer than this are encoded on a worker thread so one huge prompt
# does not hold up every other RPC on the event loop (tokenizers drops the GIL).
OFFLOAD_CHARS = 16_384

T = TypeVar("T")


def request_chars(req: tokenizer_pb2.EncodeRequest) -> int:
    """Characters an EncodeRequest asks to encode (text, or every message's content,
    calls and the tools)."""
    msgs = req.messages.messages
    calls = sum(len(c.name) + len(c.arguments) for m in msgs for c in m.tool_calls)
    return len(req.text) + sum(len(m.content) for m in msgs) + calls + tools_chars(req.tools)


def encode_request(tok: TextTokenizer, req: tokenizer_pb2.EncodeRequest) -> tuple[list[int], str]:
    """Token ids and the encoded text of one EncodeRequest (the chat template applied
    for messages): what Encode answers, for in-process callers too (the gateway).

    Raises:
        TokenizerInputError: empty, oversized or otherwise unencodable input.
    """
    which = req.WhichOneof("input")
    if which == "messages":
        msgs, tools = chat_input(tok.chat_template, req.messages.messages, req.tools)
        add_gen = req.add_generation_prompt if req.HasField("add_generation_prompt") else True
        return tok.encode_chat(msgs, add_gen, tools)
    if which == "text":
        add_sp = req.add_special_tokens if req.HasField("add_special_tokens") else True
        return tok.encode(req.text, add_sp), req.text
    raise TokenizerInputError("set either `text` or `messages` in the request")


class TokenizerServicer(tokenizer_pb2_grpc.TokenizerServicer):
    """llm.v1.Tokenizer over one TextTokenizer."""

    def __init__(self, tokenizer: TextTokenizer, model_name: str, max_batch_size: int) -> None:
        self._tok = tokenizer
        self._model = model_name
        self._max_batch = max_batch_size

    async def _guard(self, method: str, context: Context, fn: Callable[[], Awaitable[T]]) -> T:
        start = time.perf_counter()
        code = grpc.StatusCode.OK
        try:
            return await fn()
        except TokenizerInputError as e:
            code = grpc.StatusCode.INVALID_ARGUMENT
            await context.abort(code, str(e))
        except grpc.aio.AbortError:
            code = context.code() or grpc.StatusCode.UNKNOWN
            raise
        except Exception:
            code = grpc.StatusCode.INTERNAL
            log.exception("tokenizer rpc failed", method=method)
            await context.abort(code, f"internal error in {method}; see the tokenizer log")
        finally:
            REQUESTS.labels(method, code.name).inc()
            LATENCY.labels(method).observe(time.perf_counter() - start)
        raise AssertionError("unreachable")  # abort() always raises

    def _check_model(self, model: str) -> None:
        if model and model != self._model:
            raise TokenizerInputError(
                f"unknown model {model!r}; this tokenizer serves {self._model!r} "
                "(leave model empty for the default)"
            )

    def _encode_one(self, req: tokenizer_pb2.EncodeRequest) -> tokenizer_pb2.EncodeResponse:
        self._check_model(req.model)
        ids, text = encode_request(self._tok, req)
        TOKENS.labels("encode").inc(len(ids))
        return tokenizer_pb2.EncodeResponse(token_ids=ids, text=text if req.return_text else "")

    async def _encode(self, req: tokenizer_pb2.EncodeRequest) -> tokenizer_pb2.EncodeResponse:
        if request_chars(req) > OFFLOAD_CHARS:
            return await asyncio.to_thread(self._encode_one, req)
        return self._encode_one(req)

    async def Encode(
        self, request: tokenizer_pb2.EncodeRequest, context: Context
    ) -> tokenizer_pb2.EncodeResponse:
        return await self._guard("Encode", context, lambda: self._encode(request))

    async def CountTokens(
        self, request: tokenizer_pb2.EncodeRequest, context: Context
    ) -> tokenizer_pb2.CountTokensResponse:
        async def count() -> tokenizer_pb2.CountTokensResponse:
            return tokenizer_pb2.CountTokensResponse(
                num_tokens=len((await self._encode(request)).token_ids)
            )

        return await self._guard("CountTokens", context, count)

    async def EncodeBatch(
        self, request: tokenizer_pb2.EncodeBatchRequest, context: Context
    ) -> tokenizer_pb2.EncodeBatchResponse:
        async def batch() -> tokenizer_pb2.EncodeBatchResponse:
            reqs = list(request.requests)
            if not reqs:
                raise TokenizerInputError("requests is empty: send at least one EncodeRequest")
            if len(reqs) > self._max_batch:
                raise TokenizerInputError(
                    f"{len(reqs)} requests in one batch; the limit is {self._max_batch}"
                )
            plain = all(
                r.WhichOneof("input") == "text"
                and not r.model
                and not r.HasField("add_special_tokens")
                and not r.return_text
                for r in reqs
            )
            if plain:  # the common case: one parallel Rust call for the whole batch
                all_ids = await asyncio.to_thread(self._tok.encode_batch, [r.text for r in reqs])
                TOKENS.labels("encode").inc(sum(map(len, all_ids)))
                resps = [tokenizer_pb2.EncodeResponse(token_ids=ids) for ids in all_ids]
            else:
                resps = [self._encode_one(r) for r in reqs]
            return tokenizer_pb2.EncodeBatchResponse(responses=resps)

        return await self._guard("EncodeBatch", context, batch)

    async def Decode(
        self, request: tokenizer_pb2.DecodeRequest, context: Context
    ) -> tokenizer_pb2.DecodeResponse:
        async def decode() -> tokenizer_pb2.DecodeResponse:
            self._check_model(request.model)
            skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
            TOKENS.labels("decode").inc(len(request.token_ids))
            return tokenizer_pb2.DecodeResponse(text=self._tok.decode(request.token_ids, skip))

        return await self._guard("Decode", context, decode)

    async def DecodeStream(
        self,
        request_iterator: AsyncIterator[tokenizer_pb2.DecodeStreamRequest],
        context: Context,
    ) -> AsyncIterator[tokenizer_pb2.DecodeStreamResponse]:
        detok = None
        code = grpc.StatusCode.OK
        try:
            async for req in request_iterator:
                if detok is None:
                    self._check_model(req.model)
                    skip = req.skip_special_tokens if req.HasField("skip_special_tokens") else True
                    detok = self._tok.detokenizer(skip)
                try:
                    text = detok.add(req.token_ids)
                except ValueError as e:
                    raise TokenizerInputError(str(e)) from e
                if req.finish:
                    text += detok.finish()
                TOKENS.labels("decode").inc(len(req.token_ids))
                yield tokenizer_pb2.DecodeStreamResponse(text=text, num_tokens=detok.num_tokens)
                if req.finish:
                    return
            if detok is not None:  # client half-closed without finish: flush anyway
                tail = detok.finish()
                if tail:
                    yield tokenizer_pb2.DecodeStreamResponse(text=tail, num_tokens=detok.num_tokens)
        except TokenizerInputError as e:
            code = grpc.StatusCode.INVALID_ARGUMENT
            await context.abort(code, str(e))
        finally:
            REQUESTS.labels("DecodeStream", code.name).inc()

    async def GetTokenizerInfo(
        self, request: tokenizer_pb2.GetTokenizerInfoRequest, context: Context
    ) -> tokenizer_pb2.TokenizerInfo:
        async def info() -> tokenizer_pb2.TokenizerInfo:
            self._check_model(request.model)
            sp = self._tok.special
            return tokenizer_pb2.TokenizerInfo(
                model=self._model,
                vocab_size=self._tok.vocab_size,
                eos_token_ids=list(sp.eos_token_ids),
                bos_token_id=sp.bos_token_id or 0,
                has_bos_token=sp.bos_token_id is not None,
                has_chat_template=self._tok.chat_template is not None,
                max_input_chars=self._tok.max_input_chars,
            )

        return await self._guard("GetTokenizerInfo", context, info)
