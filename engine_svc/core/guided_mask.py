"""The guided rows' token masks of one step, computed while the model runs.

A guided request's mask at a step depends only on the tokens it accepted before
that step, so the engine starts computing the step's masks (``GuidedMasks.start``,
on a worker thread; llguidance releases the GIL) before the forward pass and the
sampler collects them after it (``GuidedMasks.apply``). Only the guided rows get a
mask: an int32 bitmask [guided rows, vocab/32] that is unpacked on the logits'
device into a bool tensor and applied with one ``masked_fill``; a step without a
guided row costs nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import torch

from engine_svc.core.request import Request

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


def apply_bitmask(logits: torch.Tensor, rows: Sequence[int], bitmask: torch.Tensor) -> torch.Tensor:
    """``logits`` with the tokens the bitmask forbids at ``-inf`` in ``rows`` (a copy)."""
    vocab = logits.shape[1]
    allowed = unpack(bitmask.to(logits.device, non_blocking=True), vocab)
    idx = torch.tensor(rows, device=logits.device)
    out = logits.clone()
    out[idx] = logits[idx].masked_fill(~allowed, float("-inf"))
    return out


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

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` with every guided row restricted to what its constraint allows."""
        self.future.result()
        return apply_bitmask(logits, self.rows, self.bitmask)
