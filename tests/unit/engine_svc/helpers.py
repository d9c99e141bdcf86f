"""Shared helpers for the engine tests."""

from __future__ import annotations

from engine_svc.core import LLMEngine, RequestOutput
from engine_svc.core.sched_output import SchedulerOutput
from engine_svc.core.scheduler import Scheduler


def run_to_completion(engine: LLMEngine, max_steps: int = 10_000) -> dict[str, list[RequestOutput]]:
    """Step until idle; outputs grouped by request id, in order."""
    outs: dict[str, list[RequestOutput]] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return outs
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    raise AssertionError(f"engine still busy after {max_steps} steps")


def tokens_of(outs: list[RequestOutput]) -> list[int]:
    """All streamed tokens of one request."""
    return [t for o in outs for t in o.new_token_ids]


def run_step(s: Scheduler, token: int = 5) -> SchedulerOutput:
    """One scheduler step; every sampling entry gets ``token``."""
    out = s.schedule()
    s.update_from_output(out, {e.request.request_id: token for e in out.scheduled if e.sample})
    return out


def plan(out: SchedulerOutput) -> list[tuple[str, int]]:
    """(request id, tokens scheduled) of a step, in batch order."""
    return [(e.request.request_id, e.num_new_tokens) for e in out.scheduled]
