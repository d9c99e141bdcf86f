"""The guided rows' token masks of one step, computed while the model runs.

A guided request's mask at a step depends only on the tokens it accepted before
that step, so the engine starts computing the step's masks (``GuidedMasks.start``,
on a worker thread, in llguidance's native code) before the forward pass and the
sampler collects them after it. Only the guided rows get a mask: an int32 bitmask
[guided rows, vocab/32]. A row that draws (``PendingMasks.apply``) has it unpacked on
the logits' device into an additive bias (0 or -inf, one table lookup per mask byte)
added to its logits; a greedy row (``PendingMasks.argmax``) keeps its unmasked argmax
when the mask allows that token (the argmax of the allowed tokens then: the same
token), so only the rows whose favourite is forbidden are masked and searched again.
A step without a guided row costs nothing.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import torch

from engine_svc.core.request import Request
from engine_svc.models import ops

_BITS = 32


def bitmask_width(vocab_size: int) -> int:
    """int32 words per row of a bitmask over ``vocab_size`` tokens."""
    return (vocab_size + _BITS - 1) // _BITS


def unpack(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [rows, vocab_size] of an int32 bitmask [rows, words] (bit j of word w
    allows token 32 w + j)."""
    shifts = torch.arange(_BITS, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


# bias of the 8 tokens of one mask byte: 0 where allowed, -inf where not (bit k = token k)
_BYTE_BITS = (torch.arange(256).unsqueeze(-1) >> torch.arange(8)) & 1
_BYTE_BIAS = torch.where(_BYTE_BITS.bool(), 0.0, float("-inf"))


def mask_bias(bitmask: torch.Tensor, vocab_size: int, dtype: torch.dtype) -> torch.Tensor:
    """[rows, vocab_size] of 0 (allowed) and -inf (forbidden) of an int32 bitmask, built
    on the bitmask's device by one table lookup per mask byte (several times faster on
    CPU than unpacking bits into a bool mask and a ``masked_fill``)."""
    assert sys.byteorder == "little", "the mask's bytes are read little-endian"
    rows = bitmask.shape[0]
    table = _BYTE_BIAS.to(bitmask.device, dtype)
    per_byte = torch.nn.functional.embedding(bitmask.contiguous().view(torch.uint8).long(), table)
    return per_byte.reshape(rows, -1)[:, :vocab_size]


def allows(bitmask: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """bool [rows]: whether row k of ``bitmask`` allows ``token_ids[k]``."""
    words = bitmask.gather(1, (token_ids >> 5).unsqueeze(1)).squeeze(1)
    return ((words >> (token_ids & (_BITS - 1)).to(words.dtype)) & 1).bool()


def apply_bitmask(logits: torch.Tensor, rows: Sequence[int], bitmask: torch.Tensor) -> torch.Tensor:
    """``logits`` with the tokens the bitmask forbids at ``-inf`` in ``rows`` (a copy;
    allowed logits are kept exactly)."""
    bias = mask_bias(bitmask.to(logits.device, non_blocking=True), logits.shape[1], logits.dtype)
    if len(rows) == logits.shape[0]:  # every row guided (rows are in order)
        return logits + bias
    idx = torch.tensor(rows, device=logits.device)
    return logits.index_add(0, idx, bias)


class GuidedMasks:
    """Computes masks for a step's guided rows, overlapped with the forward pass.

    Args:
        vocab_size: the logits' width.
        threads: llguidance's threads for a batch of masks (0 = its default).
    """

    def __init__(self, vocab_size: int, threads: int = 0) -> None:
        self.vocab_size = vocab_size
        self._llg = llguidance.LLExecutor(threads or None)
        self._pool: ThreadPoolExecutor | None = None

    def start(self, rows: Sequence[Request]) -> PendingMasks | None:
        """Begin the masks of the guided rows among ``rows`` (the sampler's rows, in
        order); None when no row is guided."""
        guided = [(i, r.guided.matcher) for i, r in enumerate(rows) if r.guided is not None]
        if not guided:
            return None
        bitmask = torch.empty(len(guided), bitmask_width(self.vocab_size), dtype=torch.int32)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="guided-mask")
        fut = self._pool.submit(self._fill, [m for _, m in guided], bitmask)
        return PendingMasks([i for i, _ in guided], bitmask, fut)

    def _fill(self, matchers: list[llguidance.LLMatcher], bitmask: torch.Tensor) -> None:
        width = bitmask.shape[1] * bitmask.element_size()
        pairs = [(m, k) for k, m in enumerate(matchers)]
        self._llg.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), width, len(matchers))

    def close(self) -> None:
        """Stop the worker thread (a later ``start`` makes a new one)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


class PendingMasks:
    """The masks of one step, being computed; ``apply`` waits for them."""

    __slots__ = ("bitmask", "future", "rows")

    def __init__(self, rows: list[int], bitmask: torch.Tensor, future: Future[None]) -> None:
        self.rows = rows
        self.bitmask = bitmask
        self.future = future

    def apply(self, logits: torch.Tensor, skip: Sequence[bool] = ()) -> torch.Tensor:
        """``logits`` with every guided row restricted to what its constraint allows,
        but the rows ``skip`` marks (greedy ones, left to ``argmax``)."""
        self.future.result()
        if not skip:
            return apply_bitmask(logits, self.rows, self.bitmask)
        keep = [k for k, i in enumerate(self.rows) if not skip[i]]
        if not keep:
            return logits
        return apply_bitmask(logits, [self.rows[k] for k in keep], self.bitmask[keep])

    def argmax(self, logits: torch.Tensor, chosen: torch.Tensor, greedy: Sequence[bool]) -> None:
        """Make ``chosen[i]`` (in place; the first argmax of the unmasked ``logits[i]``)
        the first argmax among the tokens its constraint allows, for every greedy
        guided row i: only the rows whose choice is forbidden are masked, and the
        other rows' logits are not read again."""
        self.future.result()
        ks = [k for k, i in enumerate(self.rows) if greedy[i]]
        if not ks:
            return
        bitmask = self.bitmask if len(ks) == len(self.rows) else self.bitmask[ks]
        bitmask = bitmask.to(logits.device, non_blocking=True)
        rows = torch.tensor([self.rows[k] for k in ks], device=logits.device)
        bad = (~allows(bitmask, chosen[rows])).nonzero().squeeze(1)
        if bad.numel() == 0:
            return
        masked = logits[rows[bad]] + mask_bias(bitmask[bad], logits.shape[1], logits.dtype)
        chosen[rows[bad]] = ops.argmax_rows(masked)
