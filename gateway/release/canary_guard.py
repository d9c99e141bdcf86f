"""The canary guard: roll a candidate back when it does measurably worse than stable.

Every ``interval_s`` each gateway replica judges, for each model whose policy
has ``guard.enabled``, every candidate (weighted non-stable version or shadow
target) against the stable version over the guard window, counting only
samples since the policy last changed (``gateway.release.version_stats``):

    candidate requests < min_requests                    -> no verdict yet
    cand error rate > stable error rate + max_increase   -> roll back
    cand p95 TTFT > stable p95 * max_ratio + slack       -> roll back (needs
                                                            min_requests on stable)

When stable has fewer than ``min_requests`` samples its error rate counts as
0 (a candidate failing on its own is enough) and TTFT is not judged. The
rollback is a compare-and-set on the revision that was judged, so an admin's
concurrent change wins; the reason is logged, audited and kept in the policy.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from common.log import get_logger
from common.tasks import cancel_and_wait
from gateway.release.policy_store import PolicyCache
from gateway.release.version_stats import VersionStats, VersionSummary
from gateway.routing_policy import RoutingPolicy
from ratelimit.errors import ConflictError

log = get_logger(__name__)
TTFT_SLACK_S = 0.05  # p95 differences below this are noise on any hardware
Rollback = Callable[[RoutingPolicy, str], Awaitable[object]]


def judge_version(
    policy: RoutingPolicy, cand: VersionSummary, stable: VersionSummary
) -> str | None:
    """Why a candidate with summary ``cand`` must be rolled back, or None."""
    g = policy.guard
    if cand.num_requests < g.min_requests:
        return None
    baseline_ok = stable.num_requests >= g.min_requests
    base_rate = stable.error_rate if baseline_ok else 0.0
    if cand.error_rate > base_rate + g.max_error_rate_increase:
        return (
            f"error rate {cand.error_rate:.1%} over {cand.num_requests} requests exceeds "
            f"stable's {base_rate:.1%} by more than {g.max_error_rate_increase:.1%}"
        )
    if (
        baseline_ok
        and cand.ttft_p95_s is not None
        and stable.ttft_p95_s is not None
        and cand.ttft_p95_s > stable.ttft_p95_s * g.max_ttft_p95_ratio + TTFT_SLACK_S
    ):
        return (
            f"p95 TTFT {cand.ttft_p95_s * 1000:.0f} ms exceeds stable's "
            f"{stable.ttft_p95_s * 1000:.0f} ms by more than x{g.max_ttft_p95_ratio:g}"
        )
    return None


def judge(policy: RoutingPolicy, stats: VersionStats) -> str | None:
    """The first candidate's rollback reason (``"<version>: <why>"``), or None."""
    g = policy.guard
    since = policy.updated_at
    stable = stats.summary(policy.model, policy.stable_version, g.window_s, since)
    for version in policy.candidates():
        cand = stats.summary(policy.model, version, g.window_s, since)
        why = judge_version(policy, cand, stable)
        if why is not None:
            return f"candidate {version!r}: {why}"
    return None


class CanaryGuard:
    """The background task that applies ``judge`` to every guarded policy.

    Args:
        policies: The policy cache.
        stats: This replica's per-version outcomes.
        rollback: Rolls a policy back with a reason (``RolloutManager.auto_rollback``).
        interval_s: Time between two passes.
    """

    def __init__(
        self,
        policies: PolicyCache,
        stats: VersionStats,
        rollback: Rollback,
        interval_s: float = 2.0,
    ) -> None:
        self.policies = policies
        self.stats = stats
        self.rollback = rollback
        self.interval_s = interval_s
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start the periodic pass."""
        self._task = asyncio.create_task(self._run(), name="canary-guard")

    async def close(self) -> None:
        """Stop it."""
        await cancel_and_wait(self._task)

    async def check_once(self) -> list[str]:
        """One pass; returns the models rolled back."""
        rolled = []
        for model, policy in (await self.policies.all()).items():
            if not policy.guard.enabled or not policy.candidates():
                continue
            why = judge(policy, self.stats)
            if why is None:
                continue
            try:
                await self.rollback(policy, why)
            except ConflictError:
                log.info("guard verdict dropped: the policy changed meanwhile", model=model)
                continue
            rolled.append(model)
        return rolled

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.check_once()
            except Exception:
                log.exception("canary guard pass failed")
