"""Native backend: our LLMEngine driven by one dedicated step-loop thread.

    asyncio side (event loop)                 step thread
    ─────────────────────────                 ───────────
    generate(): register out queue ──cmds──►  add_request -> resolve future
                await future  ◄──call_soon_threadsafe──┘
                await queue.get() ◄── dispatch(outputs) ◄── engine.step()
    abort() / stop()          ──cmds──►       abort_request / exit

The engine is built on that thread too (start() waits for it), so every torch
call of the process runs on one OpenMP team. The thread blocks on the command
queue when the engine is idle (no busy-waiting, no polling sleeps) and drains
it between steps when busy. All engine calls happen on that thread; the event
loop only moves outputs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import queue
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

from common.log import get_logger
from engine_svc import metrics
from engine_svc.backends.base import (
    BackendUnavailableError,
    DuplicateRequestError,
    GenerateInput,
    QueueFullError,
    retry_after_ms,
)
from engine_svc.core.guided import GuidedMatcher
from engine_svc.core.kv_events import KvEventLog
from engine_svc.core.llm_engine import LLMEngine
from engine_svc.core.outputs import EngineStats, ModelInfo, RequestOutput
from engine_svc.core.request import FinishReason
from engine_svc.stats import BackendStats, RateWindow

log = get_logger(__name__)

_RATE_WINDOW_S = 10.0


def _resolve(fut: asyncio.Future[bool], result: bool | None, exc: BaseException | None) -> None:
    if fut.done():  # the caller gave up (cancelled) meanwhile
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(bool(result))


def merge_outputs(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """``a`` then ``b`` as one output: when a stream's reader falls behind the engine,
    the queued steps go out as one message (fewer writes under load, none delayed)."""
    logprobs = None
    if a.new_logprobs is not None or b.new_logprobs is not None:
        logprobs = [*(a.new_logprobs or []), *(b.new_logprobs or [])]
    return dataclasses.replace(
        b, new_token_ids=[*a.new_token_ids, *b.new_token_ids], new_logprobs=logprobs
    )


class NativeBackend:
    """The PyTorch engine behind the Backend protocol.

    Args:
        engine_factory: builds the LLMEngine (called on a worker thread in start()).
    """

    name = "native"

    def __init__(self, engine_factory: Callable[[], LLMEngine]) -> None:
        self._factory = engine_factory
        self._engine: LLMEngine | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._cmds: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._queues: dict[str, asyncio.Queue[RequestOutput]] = {}
        self._thread: threading.Thread | None = None
        self._stats: EngineStats | None = None
        self._rates = RateWindow(_RATE_WINDOW_S)
        self._info: ModelInfo | None = None
        self._failed: BaseException | None = None
        self._live: set[str] = set()  # step thread only: requests the engine holds
        # step thread only: commands taken off _cmds during a step that must wait for
        # its end (an abort or stop, and everything queued after it, in order)
        self._held: deque[tuple[Any, ...]] = deque()

    async def start(self) -> None:
        """Build the engine on the step thread itself, then run the loop there.

        Every torch call of this backend happens on that one thread: libgomp
        keeps a thread team per calling thread, and once a process holds more
        OpenMP threads than CPUs it stops spinning between parallel regions,
        so a second team (the model built on an executor thread) would put
        every one of a decode step's few hundred regions behind a futex wake.
        """
        loop = self._loop = asyncio.get_running_loop()
        ready: asyncio.Future[bool] = loop.create_future()
        self._thread = threading.Thread(
            target=self._main, args=(ready,), name="engine-step-loop", daemon=True
        )
        self._thread.start()
        try:
            await ready
        except BaseException:
            await asyncio.to_thread(self._thread.join)
            self._thread = None
            raise

    async def stop(self) -> None:
        if self._thread is None:
            return
        self._cmds.put(("stop",))
        await asyncio.to_thread(self._thread.join)
        self._thread = None
        self._engine = None

    # ---- asyncio side -------------------------------------------------------

    async def generate(self, inp: GenerateInput) -> AsyncIterator[RequestOutput]:
        if self._thread is None or self._loop is None:
            raise BackendUnavailableError("the engine is not running")
        if inp.request_id in self._queues:
            raise DuplicateRequestError(
                f"request_id {inp.request_id!r} is already in use by a live request"
            )
        if self._info is not None:  # else the engine validates it (start() is not done)
            inp.validate(self._info)  # a no-op after the engine service's
        guided = await self._compile(inp)
        out_q: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._queues[inp.request_id] = out_q
        finished = False
        try:
            fut: asyncio.Future[bool] = self._loop.create_future()
            self._cmds.put(("add", inp, fut, guided))
            if not await fut:
                raise QueueFullError(
                    "the engine's waiting queue is full; retry later or on another replica",
                    self._retry_after_ms(),
                )
            while not finished:
                out = await out_q.get()
                while not out.finished and not out_q.empty():
                    out = merge_outputs(out, out_q.get_nowait())  # the reader fell behind
                finished = out.finished
                yield out
        finally:
            self._queues.pop(inp.request_id, None)
            if not finished:
                self._cmds.put(("abort", inp.request_id))

    async def _compile(self, inp: GenerateInput) -> GuidedMatcher | None:
        """The request's guided matcher, compiled here (a worker thread for a constraint
        not cached yet), never on the step loop; None for an unconstrained request.

        Raises:
            ValueError: the constraint is malformed (before anything is queued).
        """
        spec = inp.sampling_params.guided
        if spec is None or self._engine is None:
            return None  # not started yet: the engine compiles it
        compiler = self._engine.guided
        return compiler.cached(spec) or await asyncio.to_thread(compiler.matcher, spec)

    async def abort(self, request_id: str) -> None:
        self._cmds.put(("abort", request_id))

    def stats(self) -> BackendStats:
        assert self._stats is not None, "start() first"
        return BackendStats(self._stats, *self._rates.rates())

    def model_info(self) -> ModelInfo:
        assert self._info is not None, "start() first"
        return self._info

    def kv_events(self) -> KvEventLog | None:
        """The prefix cache's event log (None before start() or without prefix caching)."""
        return None if self._engine is None else self._engine.kv_cache_manager.kv_events

    def _retry_after_ms(self) -> int:
        s = self._stats
        return 1000 if s is None else retry_after_ms(s.num_waiting, s.max_num_seqs)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            q = self._queues.get(out.request_id)
            if q is not None:
                q.put_nowait(out)

    # ---- step thread --------------------------------------------------------

    def _main(self, ready: asyncio.Future[bool]) -> None:
        assert self._loop is not None
        try:
            engine = self._factory()
            self._info = engine.model_info()
            self._stats = engine.get_stats()
        except BaseException as e:
            self._loop.call_soon_threadsafe(_resolve, ready, None, e)
            return
        self._engine = engine
        self._loop.call_soon_threadsafe(_resolve, ready, True, None)
        self._run()

    def _run(self) -> None:
        engine = self._engine
        assert engine is not None
        assert self._loop is not None
        running = True
        while running:
            try:
                block = not engine.has_unfinished_requests()
                running = self._drain_commands(engine, block)
                if not running:
                    break
                outputs = engine.step(poll=lambda: self._poll(engine), emit=self._emit)
                if engine.last_step_timings is not None:
                    metrics.observe_step(engine.last_step_timings)
                    engine.last_step_timings = None
                for timings in engine.interrupt_timings:
                    metrics.observe_step(timings)
                engine.interrupt_timings.clear()
                self._publish(engine)
                self._emit(outputs)
            except Exception as e:  # never let the loop die silently
                log.exception("engine step loop failed; failing live requests")
                self._failed = e
                self._fail_all(engine)
        self._shutdown(engine)

    def _emit(self, outputs: list[RequestOutput]) -> None:
        """Hand outputs to their streams (the step's, or a nested step's mid-step)."""
        assert self._loop is not None
        metrics.observe_outputs(outputs)
        for out in outputs:
            if out.finished:
                self._live.discard(out.request_id)
        if outputs:
            self._loop.call_soon_threadsafe(self._dispatch, outputs)

    def _poll(self, engine: LLMEngine) -> None:
        """Between two layers of a step: queue new requests now (one may interrupt the
        step) and abort those the step does not run; an abort of a request the step
        runs waits for its end (the step still writes the blocks an abort would free),
        and so does a new request under the same id; a stop, and whatever came after
        it, too."""
        if self._cmds.empty():
            return  # the usual case, after every layer of a prefill step
        held_ids = {c[1] for c in self._held if c[0] == "abort"}
        stopping = any(c[0] == "stop" for c in self._held)
        while not self._cmds.empty():
            cmd = self._cmds.get_nowait()
            if stopping:
                self._held.append(cmd)
            elif cmd[0] == "add" and cmd[1].request_id not in held_ids:
                self._add(engine, *cmd[1:])
            elif cmd[0] == "abort" and cmd[1] not in engine.in_flight_request_ids | held_ids:
                engine.abort_request(cmd[1])
            else:
                self._held.append(cmd)
                if cmd[0] == "abort":
                    held_ids.add(cmd[1])
                stopping = cmd[0] == "stop"

    def _drain_commands(self, engine: LLMEngine, block: bool) -> bool:
        """Apply held, then queued commands; block for the first one when idle.
        False = stop."""
        while True:
            if self._held:
                cmd = self._held.popleft()
            else:
                try:
                    cmd = self._cmds.get(block=block)
                except queue.Empty:
                    return True
            block = False
            if cmd[0] == "stop":
                return False
            if cmd[0] == "add":
                self._add(engine, *cmd[1:])
            elif cmd[0] == "abort":
                engine.abort_request(cmd[1])
            self._publish(engine)

    def _add(
        self,
        engine: LLMEngine,
        inp: GenerateInput,
        fut: asyncio.Future[bool],
        guided: GuidedMatcher | None = None,
    ) -> None:
        assert self._loop is not None
        try:
            ok = engine.add_request(
                inp.request_id,
                inp.prompt_token_ids,
                inp.sampling_params,
                inp.priority,
                inp.resumed_output_token_ids,
                speculative=inp.speculative_decoding,
                tenant_id=inp.tenant_id,
                tenant_weight=inp.tenant_weight,
                cache_salt=inp.cache_salt,
                validated=inp.validated,
                guided=guided,
            )
        except ValueError as e:
            self._loop.call_soon_threadsafe(_resolve, fut, None, e)
            return
        except Exception as e:  # a bug must fail this call, not the step it came in
            log.exception("add_request failed", request_id=inp.request_id)
            self._loop.call_soon_threadsafe(_resolve, fut, None, e)
            return
        if ok:
            self._live.add(inp.request_id)
        self._loop.call_soon_threadsafe(_resolve, fut, ok, None)

    def _publish(self, engine: LLMEngine) -> None:
        stats = engine.get_stats()
        self._stats = stats
        self._rates.record(stats.num_prompt_tokens_total, stats.num_generation_tokens_total)

    def _fail_all(self, engine: LLMEngine) -> None:
        assert self._loop is not None
        ids, self._live = list(self._live), set()
        for rid in ids:
            try:
                engine.abort_request(rid)
            except Exception:
                log.exception("abort failed after a step-loop failure", request_id=rid)
        fails = [
            RequestOutput(rid, [], finished=True, finish_reason=FinishReason.ERROR) for rid in ids
        ]
        self._loop.call_soon_threadsafe(self._dispatch, fails)

    def _shutdown(self, engine: LLMEngine) -> None:
        """Abort whatever is left so every waiting stream ends, then report it."""
        assert self._loop is not None
        for rid in list(self._live):
            engine.abort_request(rid)
        self._live.clear()
        outputs = engine.step() if engine.has_unfinished_requests() else []
        self._publish(engine)
        if outputs:
            self._loop.call_soon_threadsafe(self._dispatch, outputs)
