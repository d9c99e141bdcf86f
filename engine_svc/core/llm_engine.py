"""LLMEngine: the synchronous step loop a service drives from one thread.

    engine = LLMEngine(EngineConfig(model_dir=...))
    engine.add_request("r1", prompt_ids, SamplingParams(max_tokens=32))
    while engine.has_unfinished_requests():
        for out in engine.step():
            ...  # out.new_token_ids, out.finished, out.finish_reason

Not thread-safe: call every method from the step-loop thread (a service
hands requests and aborts to that thread through its own queue).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from common.config import default_model_dir
from engine_svc.core.compute_choice import prepare_model
from engine_svc.core.config import EngineConfig
from engine_svc.core.guided import GuidedCompiler, GuidedMatcher
from engine_svc.core.guided_mask import GuidedMasks
from engine_svc.core.kv_cache_manager import KVCacheManager, cdiv
from engine_svc.core.model_runner import ModelRunner, determine_num_blocks
from engine_svc.core.ngram_proposer import NgramProposer
from engine_svc.core.outputs import EngineStats, ModelInfo, RequestOutput, StepTimings
from engine_svc.core.request import Request, RequestStatus
from engine_svc.core.sampler import Sampler
from engine_svc.core.sampling_params import SamplingParams
from engine_svc.core.sched_output import SchedulerOutput
from engine_svc.core.scheduler import Scheduler
from engine_svc.core.spec_decode import accept, expand_rows
from engine_svc.core.stop_checker import take_new_tokens
from engine_svc.core.threads import ThreadPolicy
from engine_svc.core.validation import validate_request
from engine_svc.models import cpu_kernels, cpu_tier, ops

logger = logging.getLogger(__name__)

PRIORITY_NORMAL = 2


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _make_output(req: Request) -> RequestOutput:
    start, end = take_new_tokens(req)
    base = req.num_resumed_tokens
    lps = req.logprobs[start - base : end - base] if req.sampling_params.logprobs else None
    return RequestOutput(
        request_id=req.request_id,
        new_token_ids=req.output_token_ids[start:end],
        new_logprobs=lps,
        finished=req.is_finished,
        finish_reason=req.finish_reason,
        stop_token_id=req.stop_token_id,
        num_prompt_tokens=req.num_prompt_tokens,
        num_cached_tokens=req.num_cached_tokens,
        num_output_tokens=req.num_output_tokens,
        num_resumed_tokens=req.num_resumed_tokens,
        num_preemptions=req.num_preemptions,
        num_draft_tokens=req.num_draft_tokens,
        num_accepted_tokens=req.num_accepted_tokens,
        arrival_time=req.arrival_time,
        first_scheduled_time=req.first_scheduled_time,
        first_token_time=req.first_token_time,
        finished_time=req.finished_time,
    )


class LLMEngine:
    """Paged-KV, in-flight-batching generation engine.

    Args:
        config: engine configuration.
        clock: monotonic seconds for timestamps and priority aging.
    """

    def __init__(self, config: EngineConfig, clock: Callable[[], float] = time.monotonic) -> None:
        if config.tensor_parallel_size != 1 or config.pipeline_parallel_size != 1:
            raise ValueError(
                "the native engine runs on one device: tensor_parallel_size and "
                "pipeline_parallel_size must be 1 (several GPUs per engine: TensorRT-LLM's "
                "trtllm-serve, reached as trtllm://)"
            )
        self.device = _resolve_device(config.device)
        self.threads = ThreadPolicy(
            config.num_threads, config.thread_policy, self.device.type == "cpu"
        )
        self.config = config
        self.clock = clock
        self.model_dir = config.model_dir or str(default_model_dir())
        # the tier cap first: the kernels build under it when first used
        cpu_tier.apply_cap(config.cpu_isa)
        self.model, self.linear_choice, kv_dtype = prepare_model(
            config, self.model_dir, self.device
        )
        self.weight_dtype = self.linear_choice.dtype
        self.model_config = self.model.config
        num_blocks = determine_num_blocks(config, self.model_config, kv_dtype, self.device)
        self.runner = ModelRunner(self.model, num_blocks, config.block_size, kv_dtype)
        self.kv_cache_manager = KVCacheManager(
            num_blocks, config.block_size, config.enable_prefix_caching
        )
        sched_cfg = config.scheduler_config(self.model_config.max_position_embeddings)
        proposer = None
        if config.num_speculative_tokens > 0:
            proposer = NgramProposer(
                config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max
            )
        self.scheduler = Scheduler(sched_cfg, self.kv_cache_manager, clock, proposer)
        self.sampler = Sampler(self.model_config.vocab_size, self.device, config.seed)
        self.eos_token_ids = tuple(self.model_config.eos_token_ids)
        vocab = self.model_config.vocab_size
        self.guided = GuidedCompiler(
            Path(self.model_dir) / "tokenizer.json", vocab, self.eos_token_ids,
            config.guided_cache_entries,
        )  # fmt: skip
        self.guided.preload()  # at start, not on the first guided request
        self.guided_masks = GuidedMasks(vocab)
        self._pending: list[RequestOutput] = []
        # requests of the step being run (its blocks are being written): an abort of one
        # of these must wait for the step's end; empty between steps
        self.in_flight_request_ids: frozenset[str] = frozenset()
        self._totals = {"requests": 0, "prompt": 0, "generation": 0, "steps": 0, "interrupts": 0}
        self.last_step_timings: StepTimings | None = None  # None until a step ran a batch
        self.interrupt_timings: list[StepTimings] = []  # of nested steps; the caller clears it
        logger.info("engine computes: %s", self.compute_description)

    @property
    def max_model_len(self) -> int:
        """Longest prompt + output a request may have."""
        return self.scheduler.config.max_model_len

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams | None = None,
        priority: int = PRIORITY_NORMAL,
        resumed_output_token_ids: Sequence[int] | None = None,
        arrival_time: float | None = None,
        speculative: bool | None = None,
        tenant_id: str = "",
        tenant_weight: float = 1.0,
        validated: bool = False,
        cache_salt: str = "",
        guided: GuidedMatcher | None = None,
    ) -> bool:
        """Queue a request.

        Args:
            request_id: unique among live requests.
            prompt_token_ids: the prompt, non-empty, ids inside the vocabulary.
            sampling_params: defaults to greedy with max_tokens 16.
            priority: llm.v1.Priority value (0 = unspecified = NORMAL).
            resumed_output_token_ids: outputs a previous replica already produced.
            arrival_time: engine-clock arrival; default now.
            speculative: prompt-lookup speculative decoding for this request;
                None = the engine's ``enable_speculative_decoding``. Has no
                effect when the engine has ``num_speculative_tokens = 0``.
            tenant_id: whose request it is: within a priority class the tenant
                served least goes first (fair share); "" = one anonymous tenant.
            tenant_weight: that tenant's share (> 0; 2 = twice a weight-1 tenant's).
            cache_salt: prefix-cache blocks are reused only between requests with the
                same salt ("" = the unsalted pool).
            validated: the caller has run ``validate_request`` on these fields against
                this engine's model (the engine service does, once per request); the
                engine's own checks (a live id, the KV pool) run either way.
            guided: a fresh matcher of ``sampling_params.guided`` compiled by the caller
                (``self.guided.matcher``, off this thread); None = compiled here.
                The resumed tokens are fed to it; a guided request never speculates.

        Returns:
            True when queued, False when the waiting queue is full (retry later).

        Raises:
            ValueError: the request can never run as given; the message says why.
        """
        params = sampling_params or SamplingParams()
        resumed = list(resumed_output_token_ids or [])
        if request_id in self.scheduler.requests:
            raise ValueError(f"request_id {request_id!r} is already in use by a live request")
        if not validated:
            validate_request(
                request_id,
                prompt_token_ids,
                params,
                priority,
                resumed,
                vocab_size=self.model_config.vocab_size,
                max_model_len=self.max_model_len,
                tenant_weight=tenant_weight,
            )
        self._check_pool(prompt_token_ids, params)
        if params.guided is not None:
            guided = guided or self.guided.matcher(params.guided)
            guided.resume(resumed)
        req = Request.create(
            request_id,
            list(prompt_token_ids),
            params,
            self.clock() if arrival_time is None else arrival_time,
            priority or PRIORITY_NORMAL,
            resumed,
            self.eos_token_ids,
            tenant_id,
            tenant_weight,
            cache_salt,
        )
        req.use_spec = guided is None and (
            self.config.enable_speculative_decoding if speculative is None else speculative
        )
        req.guided = guided
        if not self.scheduler.add_request(req):
            return False
        self._totals["requests"] += 1
        self._totals["prompt"] += req.num_prompt_tokens
        return True

    def _check_pool(self, prompt: Sequence[int], params: SamplingParams) -> None:
        blocks = cdiv(len(prompt) + params.max_tokens, self.config.block_size)
        if blocks > self.runner.num_blocks:
            raise ValueError(
                f"request needs {blocks} KV blocks but the pool has "
                f"{self.runner.num_blocks}; shorten it or raise the KV budget"
            )

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now and free its blocks; its final output comes with the next step.

        Returns:
            False when the request is unknown or already finished.
        """
        done = self.scheduler.finish_requests([request_id], RequestStatus.FINISHED_ABORTED)
        self._pending.extend(_make_output(r) for r in done)
        return bool(done)

    def has_unfinished_requests(self) -> bool:
        """True while any request is waiting or running (or an abort is unreported)."""
        return self.scheduler.has_unfinished_requests() or bool(self._pending)

    def step(
        self,
        poll: Callable[[], None] | None = None,
        emit: Callable[[list[RequestOutput]], None] | None = None,
    ) -> list[RequestOutput]:
        """Schedule, run the model once, sample, and report per-request progress.

        A failure inside the model finishes that step's requests with
        ``FinishReason.ERROR`` instead of taking the engine down.

        With ``poll`` and ``emit`` (and ``interrupt_max_tokens`` > 0), a step that
        prefills calls ``poll`` between two layers of the model; ``poll`` may queue
        requests (``add_request``) and abort any request not in
        ``in_flight_request_ids`` (the step in flight still writes those requests'
        blocks). When a request that arrived outranks the
        step's prompts (``Scheduler.schedule_interrupt``), it runs there in a step
        of its own and that step's outputs go to ``emit`` before this one resumes.
        """
        outputs, self._pending = self._pending, []
        self.threads.before_step()
        t0 = time.perf_counter()
        sched_out = self.scheduler.schedule()
        if sched_out.is_empty:
            return outputs
        self._totals["steps"] += 1
        timings = StepTimings(schedule=time.perf_counter() - t0, num_decodes=sched_out.num_decodes)
        timings.num_prefill_tokens = sum(
            e.num_new_tokens for e in sched_out.scheduled[sched_out.num_decodes :]
        )
        hook = None
        if (
            poll is not None
            and emit is not None
            and self.scheduler.config.interrupt_max_tokens > 0
            and timings.num_prefill_tokens > 0
        ):
            hook = _Interrupter(self, sched_out, poll, emit)
        self.in_flight_request_ids = frozenset(e.request.request_id for e in sched_out.scheduled)
        try:
            new, ok = self._run_step(sched_out, timings, hook)
        finally:
            self.in_flight_request_ids = frozenset()
        if ok:
            if hook is not None:
                timings.forward -= hook.seconds  # the nested steps' time is theirs
            self.last_step_timings = timings
        return outputs + new

    def _run_step(
        self, sched_out: SchedulerOutput, timings: StepTimings, hook: Callable[[], None] | None
    ) -> tuple[list[RequestOutput], bool]:
        """Execute, sample and update a scheduled step: (its outputs, whether the model ran)."""
        try:
            rows = expand_rows(sched_out.scheduled)
            masks = self.guided_masks.start(rows)  # computed while the model runs
            logits, reqs = self.runner.execute_model(sched_out, hook)
            timings.prepare = self.runner.last_prepare_s
            timings.forward = self.runner.last_forward_s
            t_sample = time.perf_counter()
            assert len(rows) == len(reqs)
            sampled = self.sampler(logits, rows, masks) if rows else None
            timings.sample = time.perf_counter() - t_sample
        except Exception:
            logger.exception(
                "model step failed; failing its %d request(s)", len(sched_out.scheduled)
            )
            return self._fail(sched_out), False
        t_update = time.perf_counter()
        token_map: dict[str, list[int]] = {}
        if sampled is not None:
            token_map = accept(sched_out.scheduled, sampled.token_ids, sampled.logprobs)
        gen_before = sum(e.request.num_output_tokens for e in sched_out.scheduled)
        updated, _finished = self.scheduler.update_from_output(sched_out, token_map)
        gen_after = sum(e.request.num_output_tokens for e in sched_out.scheduled)
        self._totals["generation"] += gen_after - gen_before
        outputs = []
        for req in updated:
            out = _make_output(req)
            if out.new_token_ids or out.finished:
                outputs.append(out)
        timings.update = time.perf_counter() - t_update
        return outputs, True

    def _fail(self, sched_out: SchedulerOutput) -> list[RequestOutput]:
        """Finish a step's requests with ``FinishReason.ERROR``; their final outputs."""
        ids = [e.request.request_id for e in sched_out.scheduled]
        failed = self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ERROR)
        return [_make_output(r) for r in failed]

    def _run_interrupt(self, sched_out: SchedulerOutput) -> list[RequestOutput]:
        """Run a step nested in the one in flight (``_Interrupter``); its outputs."""
        self._totals["steps"] += 1
        self._totals["interrupts"] += 1
        timings = StepTimings(num_prefill_tokens=sched_out.num_scheduled_tokens)
        outputs, ok = self._run_step(sched_out, timings, None)
        if ok:
            self.interrupt_timings.append(timings)
        return outputs

    def get_stats(self) -> EngineStats:
        """Queue lengths, KV usage and totals since start."""
        kv = self.kv_cache_manager
        pool = kv.block_pool
        return EngineStats(
            num_waiting=len(self.scheduler.waiting),
            num_running=len(self.scheduler.running),
            num_kv_blocks_used=pool.num_used_blocks,
            num_kv_blocks_total=pool.num_blocks,
            kv_cache_usage=pool.usage,
            num_preemptions_total=self.scheduler.num_preemptions_total,
            num_requests_total=self._totals["requests"],
            num_prompt_tokens_total=self._totals["prompt"],
            num_generation_tokens_total=self._totals["generation"],
            num_steps_total=self._totals["steps"],
            prefix_cache_queries=kv.num_prefix_queries,
            prefix_cache_hits=kv.num_prefix_hits,
            max_num_seqs=self.scheduler.config.max_num_seqs,
            max_waiting=self.scheduler.config.max_waiting,
            num_draft_tokens_total=self.scheduler.num_draft_tokens_total,
            num_accepted_tokens_total=self.scheduler.num_accepted_tokens_total,
            prefix_cache_evictions=pool.num_evictions,
            num_fair_share_tenants=fair.num_tenants if (fair := self.scheduler.fair) else 0,
            num_step_interrupts_total=self._totals["interrupts"],
        )

    def model_info(self) -> ModelInfo:
        """Static facts about the model and engine (for GetModelInfo)."""
        return ModelInfo(
            model=self.model_config.name,
            max_context_length=self.max_model_len,
            vocab_size=self.model_config.vocab_size,
            eos_token_ids=list(self.eos_token_ids),
            weight_dtype="float8_e4m3fn"
            if self.config.quantization == "fp8"
            else str(self.weight_dtype).removeprefix("torch."),
            kv_cache_dtype=str(self.runner.kv_cache.dtype).removeprefix("torch."),
            kv_block_size=self.config.block_size,
            num_kv_blocks=self.runner.num_blocks,
            device=str(self.device),
            compute=self.compute_description,
        )

    @property
    def compute_description(self) -> str:
        """How this engine computes here and why (model info, logs, metrics)."""
        c = self.linear_choice
        kernels = "native" if cpu_kernels.ops_available() else "torch"
        if self.device.type != "cpu":
            kernels = self.device.type
        attn = str(self.model.prefill_attn_dtype or self.model.attn_dtype).removeprefix("torch.")
        if self.model.prefill_attn_kernel:
            attn = f"fused {ops.prefill_kernel_label()}"
        tier = ""
        if self.device.type == "cpu":
            tier = f", {cpu_tier.report(cpu_kernels.kernel_tier()).label}"
        why = f"; measured: {c.detail}" if c.detail else ""
        return (
            f"{c.name} ({c.reason}), prefill attention {attn}, kernels={kernels}, "
            f"threads={self.threads.describe()}{tier}, kv={self.runner.kv_cache_bytes >> 20} MiB"
            f"{why}"
        )


class _Interrupter:
    """Called between two layers of a step that prefills (``LLMEngine.step``): polls
    for new requests and runs those that outrank the step's prompts, in a step of
    their own, at most ``interrupt_max_tokens`` tokens in all per step in flight."""

    def __init__(
        self,
        engine: LLMEngine,
        in_flight: SchedulerOutput,
        poll: Callable[[], None],
        emit: Callable[[list[RequestOutput]], None],
    ) -> None:
        self.engine = engine
        self.in_flight = in_flight
        self.poll = poll
        self.emit = emit
        config = engine.scheduler.config  # nested and outer activations are held at once
        self.budget = min(config.interrupt_max_tokens, config.max_num_batched_tokens)
        self.seen = engine.scheduler.num_arrivals  # only a new arrival can change the answer
        self.seconds = 0.0  # spent in nested steps

    def __call__(self) -> None:
        if self.budget <= 0:
            return  # spent: nothing polled now could run before the step ends
        self.poll()
        scheduler = self.engine.scheduler
        if scheduler.num_arrivals == self.seen:
            return
        self.seen = scheduler.num_arrivals
        t0 = time.perf_counter()
        nested = None
        try:
            nested = scheduler.schedule_interrupt(self.in_flight, self.budget)
            if nested is not None:
                self.budget -= nested.num_scheduled_tokens
                outputs = self.engine._run_interrupt(nested)
                if outputs:
                    self.emit(outputs)
        except Exception:  # fail the nested step's requests, never the step in flight
            logger.exception("interrupting step failed; failing its request(s)")
            self.budget = 0
            if nested is not None:
                try:
                    self.emit(self.engine._fail(nested))
                except Exception:
                    logger.exception("could not report the failed interrupting request(s)")
        self.seconds += time.perf_counter() - t0
