"""Verification of prompt-lookup drafts against the target model's own samples.

A speculative entry feeds ``[last, d0 .. d(k-1)]`` and gets k + 1 logit rows;
row j is the distribution after accepting ``d0 .. d(j-1)``. Each row is
sampled exactly as plain decoding would sample that position (same penalties
over the same output prefix, same min_tokens gate, same per-position seed),
and the drafts are accepted while they equal those samples::

    drafts:   d0  d1  d2  d3
    samples:  t0  t1  t2  t3  t4      t0 == d0, t1 == d1, t2 != d2
    emitted:  t0  t1  t2              2 drafts accepted, 1 pass -> 3 tokens

For a draft that is a single proposed token (a point mass, as n-gram drafts
are), this is rejection sampling: a draft d is accepted with probability
p(d), and on rejection the emitted token is distributed as p restricted to
tokens != d, renormalized. So the output is an exact sample of the target,
and greedy or seeded requests produce the very tokens plain decoding would.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

from engine_svc.core.request import Request, TokenLogprobs
from engine_svc.core.sched_output import ScheduledRequest


def row_views(req: Request, drafts: Sequence[int]) -> list[Request]:
    """One request view per logit row: row j sees the drafts before it as output."""
    views = [req]
    for j in range(1, len(drafts) + 1):
        view = copy.copy(req)
        view.output_token_ids = req.output_token_ids + list(drafts[:j])
        view.all_token_ids = req.all_token_ids + list(drafts[:j])
        views.append(view)
    return views


def expand_rows(entries: Sequence[ScheduledRequest]) -> list[Request]:
    """The per-row requests the sampler sees, in the runner's row order."""
    rows: list[Request] = []
    for e in entries:
        if e.sample:
            rows += row_views(e.request, e.spec_token_ids)
    return rows


def accept(
    entries: Sequence[ScheduledRequest],
    token_ids: Sequence[int],
    logprobs: Sequence[TokenLogprobs | None],
) -> dict[str, list[int]]:
    """Per request, the sampled tokens up to and including the first that differs from its draft.

    Logprobs of the kept tokens are appended to their request.
    """
    out: dict[str, list[int]] = {}
    row = 0
    for e in entries:
        if not e.sample:
            continue
        drafts = e.spec_token_ids
        kept: list[int] = []
        for j in range(len(drafts) + 1):
            tok = token_ids[row + j]
            kept.append(tok)
            lp = logprobs[row + j]
            if lp is not None:
                e.request.logprobs.append(lp)
            if j == len(drafts) or tok != drafts[j]:
                break
        out[e.request.request_id] = kept
        row += len(drafts) + 1
    return out
