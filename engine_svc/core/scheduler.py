"""In-flight batching scheduler with chunked prefill, priorities and preemption.

Each step, under ``max_num_batched_tokens`` and ``max_num_seqs``:

1. running decodes, most urgent first, one token each;
2. running requests still in (chunked) prefill;
3. waiting requests in priority order (with aging), while blocks remain.

When the pool runs dry the least urgent running request (lowest effective
priority, latest arrival) is preempted by recompute: its blocks are freed and
it goes back to waiting with its progress reset. No new request is admitted in
a step that preempted, so admission never causes thrashing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from engine_svc.core.config import SchedulerConfig
from engine_svc.core.kv_cache_manager import KVCacheManager
from engine_svc.core.request import Request, RequestStatus
from engine_svc.core.sched_output import ScheduledRequest, SchedulerOutput
from engine_svc.core.stop_checker import check_stop


class Scheduler:
    """Owns the waiting and running queues and the KV cache manager.

    Args:
        config: scheduling limits.
        kv_cache_manager: block tables and the pool.
        clock: monotonic seconds; injectable so tests control aging.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache_manager: KVCacheManager,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        config.validate()
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.clock = clock
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.num_preemptions_total = 0
        self._watermark_blocks = int(config.watermark * kv_cache_manager.block_pool.num_blocks)

    def get_num_unfinished_requests(self) -> int:
        """Requests waiting or running."""
        return len(self.waiting) + len(self.running)

    def has_unfinished_requests(self) -> bool:
        """True while any request is waiting or running."""
        return bool(self.waiting or self.running)

    def add_request(self, request: Request) -> bool:
        """Queue a request; False (nothing queued) when the waiting queue is full."""
        if len(self.waiting) >= self.config.max_waiting:
            return False
        self.requests[request.request_id] = request
        self.waiting.append(request)
        return True

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Finish live requests (abort/error): free their blocks, drop them from the queues."""
        assert RequestStatus.is_finished(status)
        done = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.is_finished:
                continue
            queue = self.running if req.status == RequestStatus.RUNNING else self.waiting
            queue.remove(req)
            self._finish(req, status)
            done.append(req)
        return done

    def _finish(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        req.finished_time = self.clock()
        self.kv_cache_manager.free(req)
        del self.requests[req.request_id]

    def _urgency(self, req: Request, now: float) -> tuple[float, float]:
        aged = req.priority + (now - req.arrival_time) / self.config.priority_aging_seconds
        return (-aged, req.arrival_time)

    def _chunk(self, req: Request, budget: int) -> int:
        n = min(req.num_tokens - req.num_computed_tokens, budget)
        if self.config.long_prefill_token_threshold > 0:
            n = min(n, self.config.long_prefill_token_threshold)
        return n

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        self.kv_cache_manager.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.append(req)
        out.preempted_req_ids.append(req.request_id)

    def schedule(self) -> SchedulerOutput:
        """Pick this step's batch. See the module docstring for the order."""
        now = self.clock()
        out = SchedulerOutput()
        self.running.sort(key=lambda r: self._urgency(r, now))
        chosen: dict[str, ScheduledRequest] = {}
        budget = self.config.max_num_batched_tokens
        decodes = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        prefills = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        for req in decodes + prefills:
            if budget <= 0:
                break
            if req.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            budget = self._schedule_running(req, budget, chosen, out)
        if not out.preempted_req_ids:
            budget = self._schedule_waiting(budget, now, chosen)
        entries = sorted(chosen.values(), key=lambda s: not s.is_decode)
        for entry in entries:
            entry.block_ids = self.kv_cache_manager.get_block_ids(entry.request.request_id)
        out.scheduled = entries
        out.num_scheduled_tokens = sum(s.num_new_tokens for s in entries)
        return out

    def _schedule_running(
        self, req: Request, budget: int, chosen: dict[str, ScheduledRequest], out: SchedulerOutput
    ) -> int:
        num_new = self._chunk(req, budget)
        while self.kv_cache_manager.allocate_slots(req, num_new) is None:
            victim = self.running[-1]
            self._preempt(victim, out)
            undone = chosen.pop(victim.request_id, None)
            if undone is not None:
                budget += undone.num_new_tokens
            if victim is req:
                return budget
        chosen[req.request_id] = self._entry(req, num_new)
        return budget - num_new

    def _schedule_waiting(
        self, budget: int, now: float, chosen: dict[str, ScheduledRequest]
    ) -> int:
        self.waiting.sort(key=lambda r: self._urgency(r, now))
        kv = self.kv_cache_manager
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if req.num_computed_tokens == 0:
                _blocks, num_cached = kv.get_computed_blocks(req)
                req.num_cached_tokens = num_cached
            num_new = self._chunk(req, budget)
            reserve = self._watermark_blocks if self.running else 0  # alone, it must fit
            if not kv.can_allocate(kv.num_blocks_needed(req, num_new), reserve):
                break
            kv.allocate_slots(req, num_new)
            self.waiting.pop(0)
            self.running.append(req)
            req.status = RequestStatus.RUNNING
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
            chosen[req.request_id] = self._entry(req, num_new)
            budget -= num_new
        return budget

    @staticmethod
    def _entry(req: Request, num_new: int) -> ScheduledRequest:
        sample = req.num_computed_tokens + num_new == req.num_tokens
        return ScheduledRequest(req, req.num_computed_tokens, num_new, [], sample)

    def update_from_output(
        self, output: SchedulerOutput, sampled_token_ids: dict[str, int]
    ) -> tuple[list[Request], list[Request]]:
        """Advance progress, append sampled tokens and retire finished requests.

        Args:
            output: the step's schedule.
            sampled_token_ids: the new token of every entry with ``sample`` set.

        Returns:
            (requests that received a token, requests that finished this step).
        """
        now = self.clock()
        updated, finished = [], []
        for entry in output.scheduled:
            req = entry.request
            if req.is_finished:
                continue  # aborted while the step ran
            req.num_computed_tokens += entry.num_new_tokens
            if not entry.sample:
                continue
            req.append_output_token(sampled_token_ids[req.request_id])
            if req.first_token_time is None:
                req.first_token_time = now
            updated.append(req)
            status = check_stop(req, self.config.max_model_len)
            if status is not None:
                self.running.remove(req)
                self._finish(req, status)
                finished.append(req)
        return updated, finished
