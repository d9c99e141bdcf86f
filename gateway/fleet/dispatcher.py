"""Engine attempts of one request: route, stream, retry before the first token, fail over.

    attempt 1 on replica A ──fails before any token, UNAVAILABLE/RESOURCE_EXHAUSTED──►
        backoff (full jitter), budget and attempts permitting ──► attempt 2 on replica B
    attempt on A ──fails after k tokens (UNAVAILABLE/INTERNAL/UNKNOWN/server CANCELLED)──►
        failover on, failovers left ──► same prompt + the k tokens as
        resumed_output_token_ids on replica B, remaining max_tokens budget and deadline
    every replica of the model at capacity, or each attempt failed, nothing streamed ──►
        a model route's next target (EngineJob.fallback_models), budget permitting

Every attempt goes to a replica this request has not tried, through its engine client
(``gateway.fleet.engine_client``), whatever protocol that engine speaks. Whatever ends an
attempt (done, error, stop string, client cancel) cancels its engine call at
once, so the engine frees the KV blocks, and reports the outcome to the
replica's breaker.

The caller hands in the request's ``TokenStream`` (engine chunks -> client chunks,
the request pipeline's ``TextStream``), an ``AttemptProgress`` the attempts
write (sent, answered, which replica's model), and an ``on_dispatched`` callback.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, cast

import grpc
from google.protobuf import timestamp_pb2

from common.breaker import Ticket
from common.log import get_logger
from gateway import metrics
from gateway.domain import Chunk, Deadline, GatewayError, Trace
from gateway.fleet.engine_client.base import GenerateStream
from gateway.fleet.engine_client.kv_events import PromptBlocks
from gateway.fleet.fair_queue import FairQueue, FairQueues
from gateway.fleet.replica import Replica
from gateway.fleet.replica_pool import NoReplicaError, ReplicaPool
from gateway.fleet.retry import RetryBudget, RetryPolicy, breaker_verdict, is_retryable
from gateway.spans import end_engine_call, engine_call
from llm.v1 import common_pb2, engine_pb2

log = get_logger(__name__)
FAILOVER_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.DATA_LOSS,
    }
)
# what moves a request to its model route's next target (nothing streamed yet)
FALLBACK_CODES = frozenset({grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE})


class TokenStream(Protocol):
    """The output of one request across its attempts: the tokens received so far are
    a failover's resumed output, and each engine chunk becomes a client chunk."""

    token_ids: list[int]

    @property
    def finished(self) -> bool:
        """True once the last chunk was built."""

    def on_engine_chunk(self, resp: engine_pb2.EngineGenerateResponse) -> Chunk | None:
        """The client chunk of one engine chunk (None: nothing new to send)."""


@dataclass(slots=True)
class AttemptProgress:
    """What the engine attempts of one request did so far: the dispatcher writes it,
    the pipeline reads it (the gateway's overhead, the version that served, what to
    charge when it settles)."""

    dispatched: bool = False  # the prompt was sent to an engine (prefill may be running)
    engine_answered: bool = False  # an engine accepted the request (prefill ran)
    attempt_started_at: float = 0.0  # time.perf_counter() at the latest attempt's start
    model: str = ""  # of the latest attempt's replica
    model_version: str = ""
    num_chunks: int = 0  # client chunks built

    def count(self, chunk: Chunk) -> Chunk:
        """Count a client chunk; the first names the model and version that served it."""
        if not self.num_chunks:
            chunk.model, chunk.model_version = self.model, self.model_version
        self.num_chunks += 1
        return chunk


@dataclass(slots=True)
class EngineJob:
    """What admission decided for one request.

    ``request_id`` is the id the gateway minted for the engines (never the
    client's); ``correlation_id`` is the client's, echoed in its chunks. With
    ``trace`` (tracing on) each attempt is a span and sends its own traceparent.
    """

    request_id: str
    traceparent: str
    tenant_id: str
    priority: common_pb2.Priority.ValueType
    model: str
    model_version: str  # "" = any version
    prompt_token_ids: list[int]
    sampling: engine_pb2.EngineSamplingParams
    deadline: Deadline
    stop_strings: list[str]
    fallback_versions: tuple[str, ...] = ()  # tried in order when model_version has none
    # a model route's next targets, (model, version), same tokenizer and the prompt fits:
    # tried in order when this model is at capacity or fails before the first token
    fallback_models: tuple[tuple[str, str], ...] = ()
    correlation_id: str = ""
    tenant_weight: float = 1.0  # the tenant's fair share in the engines' scheduling
    cache_salt: str = ""  # prefix-cache isolation: the tenant's (or its group's) salt
    trace: Trace | None = None


class EngineCallError(Exception):
    """One attempt failed; ``num_tokens`` of its output reached the stream first."""

    def __init__(
        self,
        replica: str,
        code: grpc.StatusCode,
        details: str,
        num_tokens: int,
        retry_after_ms: int | None = None,
    ) -> None:
        super().__init__(f"{replica} {code.name}: {details}")
        self.replica = replica
        self.code = code
        self.details = details
        self.num_tokens = num_tokens
        self.retry_after_ms = retry_after_ms


def _retry_after(e: grpc.aio.AioRpcError) -> int | None:
    trailers = cast(Sequence[tuple[str, str | bytes]], e.trailing_metadata() or ())
    for key, value in trailers:
        if key == "retry-after-ms":
            text = value.decode() if isinstance(value, bytes) else value
            return int(text) if text.isdigit() else None
    return None


def _nothing() -> None:
    pass


class Dispatcher:
    """Runs a job's engine attempts and yields client chunks.

    Args:
        pool: The replicas.
        policy: Attempts cap and backoff.
        budget: Retry budget shared by the whole gateway process.
        failover: Resume mid-stream failures on another replica.
        max_failovers: Failovers per request.
        queues: Per-tenant fair queues where a request waits when every replica of its
            model is full (None = refuse at once).
    """

    def __init__(
        self,
        pool: ReplicaPool,
        policy: RetryPolicy,
        budget: RetryBudget,
        *,
        failover: bool = True,
        max_failovers: int = 2,
        queues: FairQueues | None = None,
    ) -> None:
        self.pool = pool
        self.queues = queues if queues is not None and queues.enabled else None
        self.policy = policy
        self.budget = budget
        self.failover = failover
        self.max_failovers = max_failovers
        # Called when an attempt ends: (replica, breaker verdict, attempt start -> first
        # token in seconds or None); the per-version stats of the canary guard.
        self.on_attempt: Callable[[Replica, bool | None, float | None], None] | None = None

    async def run(
        self,
        job: EngineJob,
        text: TokenStream,
        progress: AttemptProgress,
        on_dispatched: Callable[[], None] | None = None,
    ) -> AsyncGenerator[Chunk, None]:
        """Stream the job to the end, or raise ``GatewayError``.

        ``on_dispatched`` is called as each engine call is made (its send is queued
        ahead of what the callback starts) and when the request waits for capacity
        instead: what waits for the engine's start (the overlapped admission, whose
        lease must be held while the request waits) goes then.
        """
        notify = on_dispatched or _nothing
        self.budget.record_request()
        tried: list[str] = []
        errors: list[EngineCallError] = []
        num_retries = num_failovers = 0
        queue = self.queues.of(job.model) if self.queues is not None else None
        waited = False  # it had a turn: refused again, it goes first in its tenant's line
        if queue is not None and queue.num_waiting:  # others wait for this model: no barging
            notify()
            if not await self._turn(queue, job, False):
                raise self._queue_full(job, queue)
            waited = True
        while True:
            try:
                replica, ticket = self._pick(job, tried, errors)
            except GatewayError as e:
                refused = e
            else:
                tried.append(replica.address)
                try:
                    # aclosing: a client gone mid-stream closes the attempt (cancel the
                    # engine call, release the replica) now, not when it is collected
                    attempt = self._attempt(replica, ticket, job, text, progress, notify)
                    async with contextlib.aclosing(attempt) as chunks:
                        async for chunk in chunks:
                            yield chunk
                    return
                except EngineCallError as e:
                    errors.append(e)
                    if e.num_tokens == 0 and self._may_retry(e, job, num_retries):
                        num_retries += 1
                        metrics.RETRIES.inc()
                        delay = min(self.policy.backoff(num_retries - 1), job.deadline.remaining())
                        log.info("retrying on another replica", error=str(e), delay_s=delay)
                        await asyncio.sleep(delay)
                        continue
                    if e.num_tokens > 0 and self._may_fail_over(e, num_failovers):
                        num_failovers += 1
                        metrics.FAILOVERS.inc()
                        log.warning(
                            "engine failed mid-stream; failing over",
                            error=str(e),
                            num_tokens=len(text.token_ids),
                        )
                        continue
                    refused = self._final_error(e, errors, text, job)
            # refused with nothing more to try on this model: its route's next target, a
            # turn in the fair queue, or the error
            if self._fall_back(refused, job, text):
                queue = self.queues.of(job.model) if self.queues is not None else None
                tried, errors, waited = [], [], False
                continue
            notify()
            if not await self._wait_for_capacity(refused, queue, job, text, waited):
                raise refused from None
            tried, errors, num_retries, waited = [], [], 0, True

    def _fall_back(self, error: GatewayError, job: EngineJob, text: TokenStream) -> bool:
        """Move ``job`` to its model route's next target (True) when its model is at
        capacity or failed before anything was streamed, within the retry budget; False
        when it has no next target or may not move (the caller goes on as before)."""
        if (
            not job.fallback_models
            or text.token_ids
            or error.code not in FALLBACK_CODES
            or job.deadline.expired
            or not self.budget.try_withdraw()
        ):
            return False
        (model, version), job.fallback_models = job.fallback_models[0], job.fallback_models[1:]
        reason = "capacity" if error.code == grpc.StatusCode.RESOURCE_EXHAUSTED else "failure"
        metrics.MODEL_FALLBACKS.labels(reason).inc()
        log.info(
            "model route target refused before the first token; falling back",
            from_model=job.model,
            to_model=model,
            reason=reason,
            error=error.message,
        )
        job.model, job.model_version, job.fallback_versions = model, version, ()
        return True

    async def _wait_for_capacity(
        self,
        error: GatewayError,
        queue: FairQueue | None,
        job: EngineJob,
        text: TokenStream,
        waited: bool,
    ) -> bool:
        """Every replica is full (nothing streamed yet): wait in the fair queue for a turn
        (True) or give up (False: the caller raises ``error``)."""
        if queue is None or error.code != grpc.StatusCode.RESOURCE_EXHAUSTED or text.token_ids:
            return False
        return await self._turn(queue, job, waited)

    @staticmethod
    async def _turn(queue: FairQueue, job: EngineJob, front: bool) -> bool:
        return await queue.wait(
            job.tenant_id, job.tenant_weight, job.deadline.remaining(), front=front
        )

    @staticmethod
    def _queue_full(job: EngineJob, queue: FairQueue) -> GatewayError:
        return GatewayError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"every engine replica of {job.model!r} is at capacity and {queue.num_waiting} "
            f"requests wait ahead (their longest wait is {queue.max_wait_s:g} s); retry after "
            "1000 ms",
            retry_after_ms=1000,
        )

    def _may_retry(self, e: EngineCallError, job: EngineJob, num_retries: int) -> bool:
        # Before the first token of this attempt: only the first attempt (nothing sent yet)
        # or a failover's resubmission may be retried, within the attempts cap and budget.
        return (
            is_retryable(e.code)
            and num_retries + 1 < self.policy.max_attempts
            and not job.deadline.expired
            and self.budget.try_withdraw()
        )

    def _may_fail_over(self, e: EngineCallError, num_failovers: int) -> bool:
        return self.failover and e.code in FAILOVER_CODES and num_failovers < self.max_failovers

    def _pick(
        self, job: EngineJob, tried: list[str], errors: list[EngineCallError]
    ) -> tuple[Replica, Ticket]:
        try:
            return self.pool.choose(
                job.model,
                job.model_version,
                tried,
                job.fallback_versions,
                job.tenant_id,
                prompt=PromptBlocks(job.prompt_token_ids, job.cache_salt),
            )
        except NoReplicaError as e:
            if errors:
                raise self._final_error(errors[-1], errors, None, job) from None
            raise GatewayError(
                grpc.StatusCode.UNAVAILABLE,
                f"no engine replica can serve model {job.model!r} now: {e}; retry shortly",
            ) from None

    def _final_error(
        self,
        last: EngineCallError,
        errors: list[EngineCallError],
        text: TokenStream | None,
        job: EngineJob,
    ) -> GatewayError:
        sent = len(text.token_ids) if text is not None else 0
        history = "; ".join(str(e) for e in errors)
        if last.code == grpc.StatusCode.DEADLINE_EXCEEDED or job.deadline.expired:
            return GatewayError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"the request deadline passed after {sent} output tokens",
            )
        if last.code == grpc.StatusCode.INVALID_ARGUMENT:
            return GatewayError(last.code, last.details)
        if last.code == grpc.StatusCode.RESOURCE_EXHAUSTED and sent == 0:
            wait = min(
                (e.retry_after_ms for e in errors if e.retry_after_ms is not None), default=1000
            )
            return GatewayError(
                last.code,
                f"every engine replica tried is at capacity ({history}); retry after {wait} ms",
                retry_after_ms=wait,
            )
        if sent:
            why = "failover is off" if not self.failover else "no failover left"
            return GatewayError(
                grpc.StatusCode.UNAVAILABLE,
                f"the engine failed after {sent} output tokens were sent and "
                f"the stream cannot continue ({why}): {history}",
            )
        return GatewayError(
            grpc.StatusCode.UNAVAILABLE,
            f"no engine replica could serve the request ({history}); retry shortly",
        )

    def _engine_request(
        self, job: EngineJob, text: TokenStream
    ) -> engine_pb2.EngineGenerateRequest:
        deadline = timestamp_pb2.Timestamp()
        deadline.FromNanoseconds(int(job.deadline.wall_time * 1e9))
        return engine_pb2.EngineGenerateRequest(
            request_id=job.request_id,
            prompt_token_ids=job.prompt_token_ids,
            sampling=job.sampling,
            priority=job.priority,
            tenant_id=job.tenant_id,
            tenant_weight=job.tenant_weight,
            cache_salt=job.cache_salt,
            deadline=deadline,
            model=job.model,
            resumed_output_token_ids=text.token_ids,
        )

    async def _attempt(
        self,
        replica: Replica,
        ticket: Ticket,
        job: EngineJob,
        text: TokenStream,
        progress: AttemptProgress,
        on_dispatched: Callable[[], None],
    ) -> AsyncGenerator[Chunk, None]:
        # ``replica`` was acquired by _pick: from here every path ends in release()
        verdict: bool | None = None
        num_tokens = 0
        ttft: float | None = None
        call: GenerateStream | None = None
        span = None
        failure = grpc.StatusCode.CANCELLED.name  # until it finishes or fails otherwise
        try:
            progress.attempt_started_at = time.perf_counter()
            if replica.info is not None:
                progress.model, progress.model_version = replica.info.model, replica.info.version
            span, traceparent = engine_call(
                job.trace, replica.address, job.request_id, len(text.token_ids), job.traceparent
            )
            metadata = (("x-request-id", job.request_id), ("traceparent", traceparent))
            call = replica.client.generate(
                self._engine_request(job, text), timeout=job.deadline.remaining(), metadata=metadata
            )
            progress.dispatched = True
            on_dispatched()  # after the call is made: its send runs first
            async for resp in call:
                if resp.finish_reason == common_pb2.ERROR:
                    raise EngineCallError(
                        replica.address,
                        grpc.StatusCode.INTERNAL,
                        "the engine failed the request",
                        num_tokens,
                    )
                if ttft is None and resp.token_ids:
                    ttft = time.perf_counter() - progress.attempt_started_at
                num_tokens += len(resp.token_ids)
                progress.engine_answered = True
                chunk = text.on_engine_chunk(resp)
                if chunk is not None:
                    yield progress.count(chunk)
                if text.finished:
                    verdict, failure = True, ""
                    return
            raise EngineCallError(
                replica.address,
                grpc.StatusCode.UNAVAILABLE,
                "the engine stream ended without a last chunk",
                num_tokens,
            )
        except grpc.aio.AioRpcError as e:
            code = e.code()
            verdict, failure = breaker_verdict(code), code.name
            raise EngineCallError(
                replica.address, code, e.details() or "", num_tokens, _retry_after(e)
            ) from None
        except EngineCallError as e:
            verdict, failure = False, e.code.name
            raise
        finally:
            if call is not None and not call.done():  # the engine aborts and frees KV
                call.cancel()
            end_engine_call(span, failure, num_tokens)
            replica.release(verdict, ticket)
            if self.queues is not None and failure != grpc.StatusCode.RESOURCE_EXHAUSTED.name:
                self.queues.release(job.model)  # it held engine capacity, now free
            if self.on_attempt is not None:
                self.on_attempt(replica, verdict, ttft)
