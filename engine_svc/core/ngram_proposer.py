"""Prompt-lookup drafts: continue the sequence the way it continued before.

For n from ``max_n`` down to ``min_n``, the last n tokens are searched for in
the earlier context (prompt and output so far); the most recent earlier match
proposes the up to ``k`` tokens that followed it. Extraction, summarization
and code editing repeat long spans of their input, so such drafts are often
right; free generation rarely matches and then no draft is proposed at all,
so plain decoding pays nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class NgramProposer:
    """Proposes draft tokens by n-gram matching against the request's own tokens.

    Args:
        num_speculative_tokens: most drafts per step (k).
        min_n: shortest suffix that may match.
        max_n: longest suffix tried first.
        max_context: only the last ``max_context`` tokens are searched (cost bound).
    """

    def __init__(
        self,
        num_speculative_tokens: int = 4,
        min_n: int = 2,
        max_n: int = 4,
        max_context: int = 4096,
    ) -> None:
        if num_speculative_tokens < 1 or not 1 <= min_n <= max_n:
            raise ValueError("need num_speculative_tokens >= 1 and 1 <= min_n <= max_n")
        self.k = num_speculative_tokens
        self.min_n = min_n
        self.max_n = max_n
        self.max_context = max_context

    def propose(self, token_ids: Sequence[int], max_tokens: int | None = None) -> list[int]:
        """Drafts to follow ``token_ids`` (possibly none), at most ``min(k, max_tokens)``."""
        k = self.k if max_tokens is None else min(self.k, max_tokens)
        if k <= 0 or len(token_ids) <= self.min_n:
            return []
        tokens = np.asarray(token_ids[-self.max_context :], dtype=np.int64)
        length = len(tokens)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)
            hits = np.flatnonzero((windows == tokens[length - n :]).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n
                return [int(t) for t in tokens[start : start + k]]
        return []
