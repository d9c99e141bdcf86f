"""Start-up micro-benchmarks that still choose right on a busy machine.

The engine picks weight dtype, GEMM path and prefill attention dtype by timing
the candidates on the CPU it runs on. Those timings are taken while other
processes may share the cores (tests, a neighbour's job, the engine's own
tokenizer), and a choice made on noise can cost several times the throughput
for the life of the process. Two rules make the comparison robust:

- **Interleaved rounds**: every round times each candidate once, in turn, so
  a burst of load lands on all candidates alike instead of on whichever ran
  during it.
- **Best of the rounds**: a neighbour only ever adds time, never removes it,
  so the fastest run of a deterministic computation is the closest estimate
  of its cost on a quiet machine (the median still moves with sustained load).

Timeline of ``compare_ms`` for candidates a, b, c and ``rounds=3``::

    warm-up: a a b b c c | round 1: a b c | round 2: b c a | round 3: c a b
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

Prepare = Callable[[str], None]


def compare_ms(
    candidates: Mapping[str, Callable[[], object]],
    rounds: int,
    warmup: int = 2,
    prepare: Prepare | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, float]:
    """Best-of-``rounds`` milliseconds of each candidate, timed in interleaved rounds.

    Args:
        candidates: name -> the work to time (called with no arguments).
        rounds: timed runs per candidate (>= 1).
        warmup: untimed runs per candidate before the first round.
        prepare: called with a candidate's name before each of its runs, untimed
            (e.g. to switch a shared layer to that candidate's configuration).
        clock: seconds, monotonic (injected by tests).

    Returns:
        name -> the fastest run in ms, in the order of ``candidates``.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    names = list(candidates)
    for name in names:
        for _ in range(warmup):
            if prepare is not None:
                prepare(name)
            candidates[name]()
    best = dict.fromkeys(names, float("inf"))
    for r in range(rounds):
        # rotate the order each round: no candidate always runs right after another
        for name in names[r % len(names) :] + names[: r % len(names)]:
            if prepare is not None:
                prepare(name)
            t0 = clock()
            candidates[name]()
            best[name] = min(best[name], clock() - t0)
    return {name: best[name] * 1e3 for name in names}
