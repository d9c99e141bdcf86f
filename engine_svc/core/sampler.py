"""Vectorized sampling over the step's batch.

Pipeline per row (all rows at once, a stage skipped when no row needs it):
penalties → min_tokens suppression → guided masks → temperature → top-k → top-p → min-p →
draw. The draw is an exponential race, ``argmax(p / E)`` with ``E ~ Exp(1)``,
which samples exactly from ``p``. A seeded row takes its ``E`` from a
generator seeded with ``mix(seed, output_position)``, so its tokens depend
only on its own logits, seed and position: not on the batch it ran in, not on
preemption, and not on which replica resumed it. A greedy guided row is not masked
before its argmax: its choice is checked against its mask, and searched again masked
only when forbidden (the same token, without reading the whole row twice).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine_svc.core.guided_mask import PendingMasks
from engine_svc.core.request import Request, TokenLogprobs
from engine_svc.core.sampling_params import SamplingParams
from engine_svc.models import ops

_MASK64 = (1 << 64) - 1


def mix_seed(seed: int, position: int) -> int:
    """SplitMix64 of (seed, position), folded to a non-negative int63 for torch."""
    z = (seed + (position + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


@dataclass(slots=True)
class SamplerOutput:
    """Sampled token per row and, for rows that asked, their logprobs."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


def _pad(rows: Sequence[Sequence[int]], pad: int, device: torch.device) -> torch.Tensor:
    width = max(1, max(len(r) for r in rows))
    return torch.tensor([list(r) + [pad] * (width - len(r)) for r in rows], device=device)


class Sampler:
    """Turns fp32 logits [N, vocab] into one token per request.

    Args:
        vocab_size: logits width.
        device: where the noise generators live.
        seed: seed of the stream used by unseeded rows.
    """

    def __init__(self, vocab_size: int, device: torch.device, seed: int = 0) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self._row_gen = torch.Generator(device=device)

    def __call__(
        self,
        logits: torch.Tensor,
        requests: Sequence[Request],
        guided: PendingMasks | None = None,
    ) -> SamplerOutput:
        """Sample one token per row of ``logits`` (row i belongs to ``requests[i]``);
        ``guided``: the masks of the guided rows (``GuidedMasks.start`` over these rows)."""
        params = [r.sampling_params for r in requests]
        raw = logits
        want_lp = [p.logprobs > 0 for p in params]
        lp = torch.log_softmax(raw, dim=-1) if any(want_lp) else None
        logits = self._apply_penalties(logits, requests)
        logits = self._suppress_stops(logits, requests)
        greedy = [p.greedy for p in params]
        if guided is not None:
            logits = guided.apply(logits, skip=greedy)  # the guided rows that draw
        chosen = ops.argmax_rows(logits) if all(greedy) else self._sample(logits, requests)
        if guided is not None:
            guided.argmax(logits, chosen, greedy)  # the greedy guided rows
        token_ids = chosen.tolist()
        out_lp: list[TokenLogprobs | None] = [None] * len(requests)
        if lp is not None:
            self._fill_logprobs(lp, chosen, params, out_lp)
        return SamplerOutput(token_ids, out_lp)

    def _apply_penalties(self, logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        rows = [i for i, r in enumerate(requests) if r.sampling_params.has_penalties]
        if not rows:
            return logits
        logits = logits.clone()
        v = self.vocab_size
        sel = [requests[i] for i in rows]
        idx = torch.tensor(rows, device=logits.device)
        sub = logits[idx]
        outs = _pad([r.output_token_ids for r in sel], v, logits.device)
        counts = torch.zeros(len(rows), v + 1, device=logits.device)
        counts.scatter_add_(1, outs, torch.ones_like(outs, dtype=counts.dtype))
        counts = counts[:, :v]
        rep = torch.tensor(
            [r.sampling_params.repetition_penalty for r in sel], device=logits.device
        )
        if bool((rep != 1.0).any()):
            seen = torch.zeros(len(rows), v + 1, dtype=torch.bool, device=logits.device)
            seen.scatter_(1, _pad([r.all_token_ids for r in sel], v, logits.device), True)
            seen = seen[:, :v]
            penalized = torch.where(sub > 0, sub / rep[:, None], sub * rep[:, None])
            sub = torch.where(seen, penalized, sub)
        freq = torch.tensor(
            [r.sampling_params.frequency_penalty for r in sel], device=logits.device
        )
        pres = torch.tensor([r.sampling_params.presence_penalty for r in sel], device=logits.device)
        sub = sub - freq[:, None] * counts - pres[:, None] * (counts > 0).to(sub.dtype)
        logits[idx] = sub
        return logits

    def _suppress_stops(self, logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        rows: list[int] = []
        cols: list[int] = []
        for i, r in enumerate(requests):
            p = r.sampling_params
            if r.num_output_tokens < p.min_tokens:
                ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(r.eos_token_ids))
                rows += [i] * len(ids)
                cols += sorted(ids)
        if not rows:
            return logits
        logits = logits.clone()
        logits[rows, cols] = float("-inf")
        return logits

    def _sample(self, logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        params = [r.sampling_params for r in requests]
        dev = logits.device
        greedy = torch.tensor([p.greedy for p in params], device=dev)
        temp = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params], device=dev)
        scaled = logits / temp[:, None]
        if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
            scaled = self._top_k_top_p(scaled, params)
        probs = torch.softmax(scaled, dim=-1)
        min_p = torch.tensor([p.min_p for p in params], device=dev)
        if bool((min_p > 0).any()):
            cutoff = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
            probs = torch.where(probs < cutoff, 0.0, probs)
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for i, r in enumerate(requests):
            seed = r.sampling_params.seed
            if seed is not None and not r.sampling_params.greedy:
                self._row_gen.manual_seed(mix_seed(seed, r.num_output_tokens))
                noise[i].exponential_(generator=self._row_gen)
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(greedy, ops.argmax_rows(logits), sampled)

    def _top_k_top_p(self, logits: torch.Tensor, ps: Sequence[SamplingParams]) -> torch.Tensor:
        dev = logits.device
        v = self.vocab_size
        k = torch.tensor([p.top_k if 0 < p.top_k < v else v for p in ps], device=dev)
        top_p = torch.tensor([p.top_p for p in ps], device=dev)
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        rank = torch.arange(v, device=dev)[None, :]
        sorted_logits = sorted_logits.masked_fill(rank >= k[:, None], float("-inf"))
        if bool((top_p < 1.0).any()):
            probs = sorted_logits.softmax(dim=-1)
            before = probs.cumsum(dim=-1) - probs
            sorted_logits = sorted_logits.masked_fill(before > top_p[:, None], float("-inf"))
        return torch.full_like(logits, float("-inf")).scatter_(1, order, sorted_logits)

    @staticmethod
    def _fill_logprobs(
        lp: torch.Tensor,
        chosen: torch.Tensor,
        params: Sequence[SamplingParams],
        out: list[TokenLogprobs | None],
    ) -> None:
        ns = [p.logprobs for p in params]
        chosen_lp = lp.gather(1, chosen[:, None]).squeeze(1)
        ranks = (lp > chosen_lp[:, None]).sum(dim=-1) + 1
        top_vals, top_ids = lp.topk(max(ns), dim=-1)
        c_ids, c_lp, c_rank = chosen.tolist(), chosen_lp.tolist(), ranks.tolist()
        t_vals, t_ids = top_vals.tolist(), top_ids.tolist()
        for i, n in enumerate(ns):
            if n > 0:
                out[i] = TokenLogprobs(c_ids[i], c_lp[i], c_rank[i], t_ids[i][:n], t_vals[i][:n])
