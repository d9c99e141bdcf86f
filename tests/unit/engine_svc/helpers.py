"""Shared helpers for the engine tests."""

from __future__ import annotations

from engine_svc.core import LLMEngine, RequestOutput


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
