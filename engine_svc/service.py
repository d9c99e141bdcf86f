"""Thin grpc.aio servicer for llm.v1.Engine over any Backend.

Generate yields nothing before the first token is ready, so every failure
before it (bad input, queue full, draining) is a trailers-only status that
the gateway and Envoy may retry on another replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping

import grpc
import structlog

from common import tracing
from common.log import get_logger
from common.server import Context
from engine_svc import convert, metrics
from engine_svc.backends.base import (
    Backend,
    BackendUnavailableError,
    DuplicateRequestError,
    GenerateInput,
    QueueFullError,
)
from engine_svc.core.outputs import RequestOutput
from engine_svc.core.request import FinishReason
from engine_svc.spans import EngineTrace
from llm.v1 import engine_pb2, engine_pb2_grpc
from tokenizer_svc.tokenizer import tokenizer_digest

log = get_logger(__name__)

TOKENIZER_PIECE_BYTES = 1024 * 1024  # GetTokenizer's pieces (gRPC's default cap is 4 MiB)


async def reject(context: Context, code: grpc.StatusCode, message: str, error_type: str) -> None:
    """End the call with ``code`` (counted under ``error_type``)."""
    metrics.ERRORS.labels(error_type).inc()
    await context.abort(code, message)


async def reject_backend_failure(context: Context, e: Exception, sent_tokens: int) -> None:
    """End the call with the status of a backend failure (``Backend.generate``'s errors,
    or the deadline); return for any other exception, which the caller re-raises."""
    if isinstance(e, TimeoutError):  # the backend's stream, cancelled, aborted its request
        await reject(
            context,
            grpc.StatusCode.DEADLINE_EXCEEDED,
            f"deadline exceeded after {sent_tokens} tokens; the request "
            "was aborted and its KV blocks freed",
            "deadline",
        )
    elif isinstance(e, DuplicateRequestError):
        await reject(context, grpc.StatusCode.ALREADY_EXISTS, str(e), "duplicate")
    elif isinstance(e, ValueError):
        await reject(context, grpc.StatusCode.INVALID_ARGUMENT, str(e), "invalid")
    elif isinstance(e, QueueFullError):
        context.set_trailing_metadata((("retry-after-ms", str(e.retry_after_ms)),))
        await reject(
            context,
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"{e} (retry after {e.retry_after_ms} ms)",
            "queue_full",
        )
    elif isinstance(e, BackendUnavailableError):
        await reject(context, grpc.StatusCode.UNAVAILABLE, str(e), "unavailable")


class EngineServicer(engine_pb2_grpc.EngineServicer):
    """llm.v1.Engine: validate, hand to the backend, stream, map errors.

    Args:
        tokenizer_files: The model's tokenizer files by name (``read_tokenizer_files``),
            served by GetTokenizer; empty = none (GetTokenizer: FAILED_PRECONDITION).
    """

    def __init__(
        self,
        backend: Backend,
        *,
        model_name: str,
        version: str,
        config_hash: str,
        build: str,
        tokenizer_files: Mapping[str, bytes] | None = None,
    ) -> None:
        self._backend = backend
        self._model = model_name
        self._version = version
        self._config_hash = config_hash
        self._build = build
        self._tokenizer_files = dict(tokenizer_files or {})
        self._tokenizer_digest = (
            tokenizer_digest(self._tokenizer_files) if self._tokenizer_files else ""
        )
        self.draining = False
        self.num_active = 0
        self._idle = asyncio.Event()
        self._idle.set()

    async def Generate(
        self, request: engine_pb2.EngineGenerateRequest, context: Context
    ) -> AsyncIterator[engine_pb2.EngineGenerateResponse]:
        try:
            inp = convert.generate_input_from_proto(request, self._model)
        except ValueError as e:
            await reject(context, grpc.StatusCode.INVALID_ARGUMENT, str(e), "invalid")
        await self.admit(inp, context)
        structlog.contextvars.bind_contextvars(request_id=inp.request_id, tenant=inp.tenant_id)
        timeout = convert.deadline_seconds(request, context.time_remaining())
        tracer = tracing.tracer()
        trace = None
        if tracer is not None:
            trace = EngineTrace(tracer, context.invocation_metadata() or (), self._model)
            trace.request(inp)
        try:
            first = True
            async for out in self.outputs(inp, timeout, context, trace):
                yield convert.response_from_output(out, first, time.monotonic())
                first = False
        finally:
            if trace is not None:
                trace.end(context.code())

    @contextlib.contextmanager
    def in_flight(self) -> Iterator[None]:
        """Count one stream as in flight (``drain`` waits for it), whatever protocol
        serves it."""
        self.num_active += 1
        self._idle.clear()
        try:
            yield
        finally:
            self.num_active -= 1
            if self.num_active == 0:
                self._idle.set()

    async def admit(self, inp: GenerateInput, context: Context) -> None:
        """Refuse what cannot start: UNAVAILABLE while draining, INVALID_ARGUMENT for a
        request the model can never run (validated once, here, for every backend and
        protocol; the backends see it validated and do not repeat it)."""
        if self.draining:
            await reject(
                context,
                grpc.StatusCode.UNAVAILABLE,
                "this engine replica is draining; retry on another replica",
                "draining",
            )
        try:
            inp.validate(self._backend.model_info())
        except ValueError as e:
            await reject(context, grpc.StatusCode.INVALID_ARGUMENT, str(e), "invalid")

    async def outputs(
        self,
        inp: GenerateInput,
        seconds_left: float | None,
        context: Context,
        trace: EngineTrace | None = None,
        edit: Callable[[RequestOutput], RequestOutput] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """The backend's outputs of an admitted request, the last one finished, counted in
        flight; whatever protocol serves it. ``edit`` may end an output early (a stop
        string the servicer matched). Failures end the call with their status; leaving
        early (client gone, deadline, a stop string) aborts the request and frees its KV
        blocks."""
        loop = asyncio.get_running_loop()
        when = None if seconds_left is None else loop.time() + max(0.0, seconds_left)
        stream = self._backend.generate(inp)
        finished, sent_tokens = False, 0
        with self.in_flight():
            try:
                while not finished:
                    async with asyncio.timeout_at(when):
                        out = await anext(stream)
                    if edit is not None:
                        out = edit(out)
                    if trace is not None:
                        trace.last = out
                    finished = out.finished
                    if finished:
                        self._finished(out, inp.priority)
                        if out.finish_reason == FinishReason.ERROR and sent_tokens == 0:
                            await reject(
                                context,
                                grpc.StatusCode.UNAVAILABLE,
                                "the engine failed to run this request; retry on another replica",
                                "engine_error",
                            )
                    sent_tokens += len(out.new_token_ids)
                    yield out
            except Exception as e:  # a backend failure ends the call with its status
                await reject_backend_failure(context, e, sent_tokens)
                raise
            finally:
                # Closing the backend's stream aborts the request this call registered
                # (client gone, deadline, error, stop string) and frees its KV blocks at
                # once. Never abort by id here: a call refused as a duplicate must not end
                # the live request holding that id.
                await stream.aclose()  # type: ignore[attr-defined]

    @staticmethod
    def _finished(out: RequestOutput, priority: int) -> None:
        metrics.observe_finished(out, priority)
        log.info(
            "request finished",
            finish_reason=str(out.finish_reason),
            prompt_tokens=out.num_prompt_tokens,
            output_tokens=out.num_output_tokens,
            cached_tokens=out.num_cached_tokens,
            preemptions=out.num_preemptions,
        )

    async def GetStats(
        self, request: engine_pb2.GetStatsRequest, context: Context
    ) -> engine_pb2.EngineStats:
        s = self._backend.stats()
        e = s.engine
        return engine_pb2.EngineStats(
            num_waiting=e.num_waiting,
            num_running=e.num_running,
            num_kv_blocks_used=e.num_kv_blocks_used,
            num_kv_blocks_total=e.num_kv_blocks_total,
            kv_cache_usage=e.kv_cache_usage,
            num_preemptions_total=e.num_preemptions_total,
            prompt_tokens_per_second=s.prompt_tokens_per_second,
            generation_tokens_per_second=s.generation_tokens_per_second,
            prefix_cache_hit_rate=e.prefix_cache_hit_rate,
            max_num_seqs=e.max_num_seqs,
            max_waiting=e.max_waiting,
            draining=self.draining,
            num_requests_total=e.num_requests_total,
            model_version=self._version,
            num_fair_share_tenants=e.num_fair_share_tenants,
        )

    async def GetModelInfo(
        self, request: engine_pb2.GetModelInfoRequest, context: Context
    ) -> engine_pb2.ModelInfo:
        return convert.model_info_to_proto(
            self._backend.model_info(),
            version=self._version,
            config_hash=self._config_hash,
            build=self._build,
            served_model=self._model,
            tokenizer_digest=self._tokenizer_digest,
        )

    async def GetTokenizer(
        self, request: engine_pb2.GetTokenizerRequest, context: Context
    ) -> AsyncIterator[engine_pb2.TokenizerFilePiece]:
        if not self._tokenizer_files:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"engine for {self._model!r} serves no tokenizer: its model directory has no "
                "tokenizer.json; give the gateway a model_dir with the tokenizer instead",
            )
        for name, data in self._tokenizer_files.items():
            for start in range(0, max(1, len(data)), TOKENIZER_PIECE_BYTES):
                yield engine_pb2.TokenizerFilePiece(
                    name=name,
                    data=data[start : start + TOKENIZER_PIECE_BYTES],
                    file_size=len(data),
                    digest=self._tokenizer_digest,
                )

    async def drain(self, grace_seconds: float) -> None:
        """Stop admitting; wait up to ``grace_seconds`` for in-flight streams to end."""
        self.draining = True
        log.info("draining", in_flight=self.num_active, grace_seconds=grace_seconds)
        try:
            await asyncio.wait_for(self._idle.wait(), grace_seconds)
        except TimeoutError:
            log.warning("grace period over; cancelling the rest", in_flight=self.num_active)
