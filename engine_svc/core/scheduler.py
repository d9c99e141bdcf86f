"""In-flight batching scheduler with chunked prefill, priorities and preemption.

Each step, under ``max_num_batched_tokens`` and ``max_num_seqs``:

1. running decodes, most urgent first, one token each;
2. running requests still in (chunked) prefill;
3. waiting requests in priority order (with aging), while blocks remain.

The order (priority classes with aging, fair share between tenants, the
priority-isolation floor, the waiting order) is ``request_order.RequestOrder``,
made by ``create_request_order``; the scheduler asks it which request comes
first and keeps the queues, the budgets and the blocks. While prompts of two or
more tenants wait for prefill, each prefill chunk is capped (``prefill_cap``);
in a step that admits a whole prompt under that cap, the prefills after it
share one chunk, so the step that gives the newcomer its first token stays short.

When the pool runs dry the least urgent running request (lowest effective
priority, latest arrival) is preempted by recompute: its blocks are freed and
it goes back to waiting with its progress reset. No new request is admitted in
a step that preempted for lack of blocks, so admission never causes thrashing.

Optionally (``priority_isolation``) a step that admits a request of a higher
class than every running one runs that class alone, and (``priority_window_s``)
lower classes' prefill chunks are capped for a while after an urgent arrival.
(If the urgent request cannot be admitted, the step runs as usual, so isolation
never stalls the engine.)

A step in flight can be interrupted (``interrupt_max_tokens``): between two of
its layers, a request that arrived meanwhile, outranks every prompt of that step
and has a short whole prompt runs at once in a step of its own and gets its
first token (``schedule_interrupt``); the step in flight then resumes.

When the batch is full (``max_num_seqs``) and the most urgent waiting request
outranks the least urgent running one by a whole priority class (aging
included), that running request is preempted to make room: a CRITICAL arrival
does not wait for a LOW stream to finish. Aging bounds it: a LOW request that
has waited/run long enough ranks like a higher class and is no longer displaced.

Waiting requests first take the longest cached prefix of full blocks (prefix
caching); a decode with speculation on carries n-gram draft tokens and is
scheduled as ``1 + len(drafts)`` tokens, verified in the same forward pass.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence

from engine_svc.core.config import SchedulerConfig
from engine_svc.core.fair_share import FairShare
from engine_svc.core.kv_cache_manager import KVCacheManager
from engine_svc.core.ngram_proposer import NgramProposer
from engine_svc.core.request import Request, RequestStatus
from engine_svc.core.request_order import create_request_order
from engine_svc.core.sched_output import ScheduledRequest, SchedulerOutput
from engine_svc.core.stop_checker import check_stop


class Scheduler:
    """Owns the waiting and running queues and the KV cache manager.

    Args:
        config: scheduling limits.
        kv_cache_manager: block tables and the pool.
        clock: monotonic seconds; injectable so tests control aging.
        proposer: n-gram draft proposer for requests with ``use_spec``; None = off.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache_manager: KVCacheManager,
        clock: Callable[[], float] = time.monotonic,
        proposer: NgramProposer | None = None,
    ) -> None:
        config.validate()
        self.config = config
        self.proposer = proposer
        self.kv_cache_manager = kv_cache_manager
        self.clock = clock
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.num_preemptions_total = 0
        self.num_draft_tokens_total = 0
        self.num_accepted_tokens_total = 0
        self._watermark_blocks = int(config.watermark * kv_cache_manager.block_pool.num_blocks)
        self.order = create_request_order(config)
        self._chunk_cap = 0  # this step's cap on one request's prefill chunk (0 = none)
        self._floor: int | None = None  # this step runs only classes >= this (isolation)
        self._urgent_class = 0  # lower classes' prefill chunks are capped this step
        self.num_arrivals = 0  # requests queued since start (an interruption looks for new ones)

    @property
    def fair(self) -> FairShare | None:
        """The tenants' fair-share counters, None when fair share is off."""
        return self.order.fair

    def has_unfinished_requests(self) -> bool:
        """True while any request is waiting or running."""
        return bool(self.waiting or self.running)

    def add_request(self, request: Request) -> bool:
        """Queue a request; False (nothing queued) when the engine is full: the running
        batch's free slots count as room, so a burst that the next step admits is not
        refused just because it has not been scheduled yet."""
        cap = self.config.max_num_seqs + self.config.max_waiting
        if len(self.waiting) + len(self.running) >= cap:
            return False
        self.requests[request.request_id] = request
        self.waiting.append(request)
        self.order.queued(request, self.clock())
        self.num_arrivals += 1
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
        self.order.released(req)

    def _chunk(self, req: Request, budget: int) -> int:
        n = min(req.num_tokens - req.num_computed_tokens, budget)
        if self.config.long_prefill_token_threshold > 0:
            n = min(n, self.config.long_prefill_token_threshold)
        if self._chunk_cap > 0:
            n = min(n, self._chunk_cap)
        if req.priority < self._urgent_class and self.config.fair_prefill_chunk > 0:
            n = min(n, self.config.fair_prefill_chunk)  # a higher class is about
        return n

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        self.kv_cache_manager.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.append(req)
        out.preempted_req_ids.append(req.request_id)

    def _make_room_for_priority(self, now: float, out: SchedulerOutput) -> None:
        """Preempt the least urgent running request for a waiting one a class above it."""
        if not self.waiting or len(self.running) < self.config.max_num_seqs:
            return
        head = min(self.waiting, key=lambda r: self.order.urgency(r, now))
        victim = self.running[-1]  # sorted most urgent first
        if self.order.outranks_by_class(head, victim, now):
            self._preempt(victim, out)

    def schedule(self) -> SchedulerOutput:
        """Pick this step's batch. See the module docstring for the order."""
        now = self.clock()
        out = SchedulerOutput()
        self.running.sort(key=lambda r: self.order.urgency(r, now))
        self._chunk_cap = self.order.prefill_cap(self.waiting, self.running)
        self._urgent_class = self.order.recent_top_class(now)
        self._trim_batch(out)
        self._make_room_for_priority(now, out)
        num_priority_preemptions = out.num_preempted_for_room = len(out.preempted_req_ids)
        chosen: dict[str, ScheduledRequest] = {}
        self._floor = self.order.isolation_floor(self.waiting, self.running, now)
        self._fill(now, chosen, out, num_priority_preemptions)
        if self._floor is not None and not chosen:
            self._floor = None  # the urgent request cannot start now: run the step as usual
            self._fill(now, chosen, out, num_priority_preemptions)
        self._floor = None
        return self._with_blocks(out, sorted(chosen.values(), key=lambda s: not s.is_decode))

    def schedule_interrupt(self, in_flight: SchedulerOutput, budget: int) -> SchedulerOutput | None:
        """A step to run inside ``in_flight`` (between two of its layers), or None.

        It admits waiting requests, most urgent first, whose whole prompt fits in
        ``budget`` tokens and that outrank every prompt ``in_flight`` prefills: of a
        higher class (aged), or, under fair share and when ``in_flight`` carries
        more than ``interrupt_max_tokens`` prompt tokens, of a tenant with no prompt
        in it whose counter is no higher than the least of theirs (a tenant alone
        never interrupts itself). Each admission is charged, which may stop the
        next one. On a full batch only a request a whole class above running ones
        gets a seat (``_has_seat``), and in a step that preempted for lack of blocks
        only a higher class interrupts. Nothing running is scheduled or preempted, so
        the requests of ``in_flight`` keep their blocks; None when nothing
        qualifies or fits.
        """
        prompts = in_flight.scheduled[in_flight.num_decodes :]
        if budget <= 0 or not self.waiting or not prompts:
            return None
        now = self.clock()
        by_share = (  # not in a step short of blocks: a level tenant must not cause thrashing
            self.fair is not None
            and not in_flight.short_of_blocks
            and sum(e.num_new_tokens for e in prompts) > self.config.interrupt_max_tokens
        )
        outranks = self.order.outranks_in_flight([e.request for e in prompts], by_share, now)
        cap = self.config.long_prefill_token_threshold or budget
        self._chunk_cap, self._urgent_class = 0, 0
        chosen: dict[str, ScheduledRequest] = {}
        for req in sorted(self.waiting, key=lambda r: self.order.urgency(r, now)):
            if budget <= 0 or not self._has_seat(req, now):
                break
            if not outranks(req) or req.num_tokens > min(budget, cap):
                continue  # a partial prompt would give no first token
            admitted = self._admit(req, budget, now, chosen)
            if admitted == 0:
                break  # no blocks: the step in flight keeps what it holds
            budget -= admitted
        return self._with_blocks(SchedulerOutput(), list(chosen.values())) if chosen else None

    def _with_blocks(
        self, out: SchedulerOutput, entries: list[ScheduledRequest]
    ) -> SchedulerOutput:
        """``out`` with ``entries`` as its batch, each with its block table."""
        for entry in entries:
            entry.block_ids = self.kv_cache_manager.get_block_ids(entry.request.request_id)
        out.scheduled = entries
        out.num_scheduled_tokens = sum(e.num_new_tokens for e in entries)
        return out

    def _has_seat(self, req: Request, now: float) -> bool:
        """Room in the batch for an interruption: below ``max_num_seqs``, or past it
        while ``req`` outranks by a whole class more running requests than the
        batch is over (the next step preempts them, ``_trim_batch``)."""
        over = len(self.running) - self.config.max_num_seqs
        if over < 0:
            return True
        return sum(1 for r in self.running if self.order.outranks_by_class(req, r, now)) > over

    def _trim_batch(self, out: SchedulerOutput) -> None:
        """Preempt the least urgent running requests past ``max_num_seqs`` (left there
        by interruptions; ``self.running`` is sorted most urgent first)."""
        while len(self.running) > self.config.max_num_seqs:
            self._preempt(self.running[-1], out)

    def _fill(
        self,
        now: float,
        chosen: dict[str, ScheduledRequest],
        out: SchedulerOutput,
        num_priority_preemptions: int,
    ) -> None:
        """Decodes, then prefills and admissions, into ``chosen`` under the step's budget;
        classes below the isolation floor (if any) are left out."""
        budget = self.config.max_num_batched_tokens
        live = self.order.eligible(self._floor, self.running, now)
        decodes = [r for r in live if r.num_tokens - r.num_computed_tokens == 1]
        prefills = [r for r in live if r.num_tokens - r.num_computed_tokens > 1]
        for req in decodes:
            if budget <= 0:
                break
            if req.status == RequestStatus.RUNNING:  # not preempted earlier in this loop
                budget = self._schedule_running(req, budget, chosen, out)
        self._schedule_prefills(prefills, budget, now, chosen, out, num_priority_preemptions)

    def _schedule_running(
        self, req: Request, budget: int, chosen: dict[str, ScheduledRequest], out: SchedulerOutput
    ) -> int:
        num_new = self._chunk(req, budget)
        req.spec_token_ids = self._propose(req, budget) if num_new == 1 else []
        if req.spec_token_ids and (
            self.kv_cache_manager.allocate_slots(req, 1 + len(req.spec_token_ids)) is not None
        ):
            num_new += len(req.spec_token_ids)
            chosen[req.request_id] = self._entry(req, num_new)
            self.order.charge(req, num_new)
            return budget - num_new
        req.spec_token_ids = []
        while self.kv_cache_manager.allocate_slots(req, num_new) is None:
            victim = self.running[-1]
            undone = chosen.pop(victim.request_id, None)
            if undone is not None:
                budget += undone.num_new_tokens
                self.order.charge(victim, undone.num_new_tokens, -1)  # before its progress resets
            self._preempt(victim, out)
            if victim is req:
                return budget
        chosen[req.request_id] = self._entry(req, num_new)
        self.order.charge(req, num_new)
        return budget - num_new

    def _propose(self, req: Request, budget: int) -> list[int]:
        if self.proposer is None or not req.use_spec:
            return []
        params = req.sampling_params
        room = min(
            budget - 1,
            params.max_tokens - req.num_output_tokens - 1,
            self.config.max_model_len - req.num_tokens - 1,
        )
        return self.proposer.propose(req.all_token_ids, room) if room > 0 else []

    def _schedule_prefills(
        self,
        prefills: list[Request],
        budget: int,
        now: float,
        chosen: dict[str, ScheduledRequest],
        out: SchedulerOutput,
        num_priority_preemptions: int,
    ) -> None:
        """The budget left after decodes, to running prefills and waiting requests.

        Without fair share, running prefills first, then admissions. With it, the
        two interleave most urgent first (class, then tenant counter), so a running
        long prompt of a tenant served a lot does not take the budget a new short
        prompt of another tenant would get. Nothing is admitted once this step has
        preempted for lack of blocks (admission must not cause thrashing)."""
        running = deque(prefills)
        pick = self.order.waiting_order(self.waiting, self.running, now, self._floor)
        head = pick()
        while budget > 0:
            while running and running[0].status != RequestStatus.RUNNING:
                running.popleft()  # preempted earlier in this step
            admit = (
                head is not None
                and len(out.preempted_req_ids) == num_priority_preemptions
                and len(self.running) < self.config.max_num_seqs
            )
            if (
                head is not None
                and admit
                and (not running or self.order.ahead(head, running[0], now))
            ):
                admitted = self._admit(head, budget, now, chosen)
                if admitted == 0:
                    head = None  # the most urgent one does not fit: admit no other
                else:
                    budget -= admitted
                    if self._chunk_cap and head.num_computed_tokens + admitted >= head.num_tokens:
                        # its whole prompt runs now, beside another tenant's (the cap is
                        # on): keep this step, its first token, short; the other prompts
                        # get one chunk between them in this step, not one chunk each
                        budget = min(budget, self._chunk_cap)
                    head = pick()
            elif running:
                budget = self._schedule_running(running.popleft(), budget, chosen, out)
                if head is not None and self.fair is not None:
                    head = pick()  # that charge may have put another tenant's request first
            else:
                break

    def _admit(
        self, req: Request, budget: int, now: float, chosen: dict[str, ScheduledRequest]
    ) -> int:
        """Start a waiting request with its first chunk; the tokens scheduled, or 0 when
        its blocks (plus the watermark, beside running requests) are not free."""
        kv = self.kv_cache_manager
        hits, num_cached = kv.get_computed_blocks(req)
        req.num_computed_tokens = num_cached
        num_new = self._chunk(req, budget)
        reserve = self._watermark_blocks if self.running else 0  # alone, it must fit
        if not kv.can_allocate(kv.num_blocks_needed(req, num_new, hits), reserve):
            req.num_computed_tokens = 0
            return 0
        kv.allocate_slots(req, num_new, new_computed_blocks=hits)
        kv.record_prefix_query(req.num_tokens, num_cached)
        req.num_cached_tokens = num_cached
        self.waiting.remove(req)
        self.running.append(req)
        req.status = RequestStatus.RUNNING
        if req.first_scheduled_time is None:
            req.first_scheduled_time = now
        chosen[req.request_id] = self._entry(req, num_new)
        self.order.charge(req, num_new)
        return num_new

    @staticmethod
    def _entry(req: Request, num_new: int) -> ScheduledRequest:
        spec = req.spec_token_ids
        sample = req.num_computed_tokens + num_new - len(spec) == req.num_tokens
        return ScheduledRequest(req, req.num_computed_tokens, num_new, [], sample, list(spec))

    def update_from_output(
        self, output: SchedulerOutput, sampled_token_ids: Mapping[str, int | Sequence[int]]
    ) -> tuple[list[Request], list[Request]]:
        """Advance progress, append sampled tokens and retire finished requests.

        A speculative entry brings ``accepted drafts + 1`` tokens: the cache
        keeps only the verified positions (the rest is trimmed and overwritten
        later), and a stop inside them drops the tokens after it.

        Args:
            output: the step's schedule.
            sampled_token_ids: the new token(s) of every entry with ``sample`` set.

        Returns:
            (requests that received a token, requests that finished this step).
        """
        now = self.clock()
        updated, finished = [], []
        for entry in output.scheduled:
            req = entry.request
            if req.is_finished:
                continue  # aborted while the step ran
            num_spec = len(entry.spec_token_ids)
            req.num_computed_tokens += entry.num_new_tokens - num_spec
            if not entry.sample:
                self.kv_cache_manager.cache_blocks(req)
                continue
            new = sampled_token_ids[req.request_id]
            status = self._append(req, [new] if isinstance(new, int) else new, num_spec)
            if req.first_token_time is None:
                req.first_token_time = now
            updated.append(req)
            if status is not None:
                self.running.remove(req)
                self._finish(req, status)
                finished.append(req)
        return updated, finished

    def _append(self, req: Request, tokens: Sequence[int], num_spec: int) -> RequestStatus | None:
        """Append verified tokens one by one, stopping at the first stop condition."""
        status = None
        for i, tok in enumerate(tokens):
            if i > 0:  # token i-1 was an accepted draft: its KV is valid
                req.num_computed_tokens += 1
            req.append_output_token(tok)
            if req.guided is not None:
                req.guided.advance(tok)
            status = check_stop(req, self.config.max_model_len)
            if status is not None:
                break
        if num_spec:
            req.num_draft_tokens += num_spec
            req.num_accepted_tokens += len(tokens) - 1
            self.num_draft_tokens_total += num_spec
            self.num_accepted_tokens_total += len(tokens) - 1
            self.kv_cache_manager.trim(req, req.num_tokens)
        self.kv_cache_manager.cache_blocks(req)
        return status
