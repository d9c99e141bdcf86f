"""The step loop's intra-op threads, and what a co-tenant on the same cores does to them.

A decode step runs a few hundred short OpenMP regions (``at::parallel_for``), each
ending in a barrier that waits for its slowest thread. When another process keeps
one of the engine's cores busy (a neighbour pod on a shared node), the thread on
that core gets a fraction of it in scheduler slices of milliseconds, and every
region waits for it: a 2-thread step then runs far slower than the same step on
one thread alone. So with ``engine_core.thread_policy: adaptive`` (the default on
CPU) the step thread checks, at most once per ``CHECK_INTERVAL_S``, how busy the
CPUs it may run on are with work that is not this process's (``/proc/stat``
busy and steal time of those CPUs, less this process's own CPU time), and runs
on one thread per core the others leave free (``choose_threads``: never more
than the pool it started with, never fewer than one, and back up only with a
margin, so it does not flap). ``fixed`` keeps the start-up count. Every change
is logged; the current count and the policy are in GetModelInfo's ``compute``.

A container's CPU limit is a quota, not an affinity: a pod limited to 2 CPUs on a
64-core node still sees 64 CPUs, and torch's default of a thread per core then has
64 threads share 2 CPUs' worth of time, each region's barrier waiting on threads the
quota has throttled. So the default count (``num_threads: 0``) is also capped at
the cgroup's CPU quota (``cpu_quota``: cgroup v2 ``cpu.max``, v1
``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``), rounded up; the adaptive policy
then never grows past it (free cores elsewhere on the node are not time the
quota grants).

``torch.set_num_threads`` sets the OpenMP thread count of the calling thread
only, so the policy is created and ticked on the step-loop thread.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

POLICIES = ("adaptive", "fixed")
CHECK_INTERVAL_S = 0.5
# going up needs this much more free core than rounding would: a co-tenant that
# just left must stay gone for a whole interval before the pool grows back
UP_MARGIN = 0.2
# /proc/stat cpuN columns counted busy: user nice system (idle iowait) irq softirq steal
_BUSY_COLUMNS = (0, 1, 2, 5, 6, 7)
# torch's own count before any engine changed it: an engine built after another one
# lowered it on the same thread starts from this again, not from the lowered count
DEFAULT_THREADS = torch.get_num_threads()


CGROUP_ROOT = Path("/sys/fs/cgroup")


def cpu_quota(root: Path = CGROUP_ROOT) -> float | None:
    """CPUs' worth of time this container's cgroup may use (``2.5`` for a quota of 250 ms
    per 100 ms), or None where it sets none or there is no cgroup CPU controller to read.
    Reads cgroup v2 (``cpu.max``: ``max 100000`` or ``250000 100000``) at ``root``, else
    cgroup v1 (``cpu.cfs_quota_us``, -1 for none, and ``cpu.cfs_period_us``) under
    ``root/cpu`` or ``root/cpu,cpuacct``; a malformed file counts as none."""

    def read(path: Path) -> str | None:
        try:
            return path.read_text().strip()
        except OSError:
            return None

    v2 = read(root / "cpu.max")
    if v2 is not None:
        quota, _, period = v2.partition(" ")
        pair = (quota, period or "100000")
    else:
        for sub in ("cpu", "cpu,cpuacct"):
            q, p = read(root / sub / "cpu.cfs_quota_us"), read(root / sub / "cpu.cfs_period_us")
            if q is not None and p is not None:
                pair = (q, p)
                break
        else:
            return None
    try:
        quota_us, period_us = int(pair[0]), int(pair[1])
    except ValueError:
        return None  # "max" (v2) and malformed files alike
    if quota_us <= 0 or period_us <= 0:
        return None  # v1's -1: no quota
    return quota_us / period_us


def default_threads(quota: float | None, torch_default: int) -> int:
    """torch's default count, capped at the cgroup quota rounded up (never below 1)."""
    if quota is None:
        return torch_default
    return max(1, min(torch_default, math.ceil(quota)))


@dataclass(frozen=True, slots=True)
class CpuSample:
    """One reading: wall seconds, the CPU seconds every process (and the hypervisor's
    steal) spent on our CPUs, and this process's own CPU seconds."""

    wall: float
    busy: float
    own: float


def others_busy(a: CpuSample, b: CpuSample) -> float:
    """Cores kept busy by other processes (and steal) between two samples."""
    wall = b.wall - a.wall
    if wall <= 0:
        return 0.0
    return max(0.0, ((b.busy - a.busy) - (b.own - a.own)) / wall)


def choose_threads(cores: int, others: float, current: int, limit: int) -> int:
    """Threads for the next interval: one per core of ``cores`` that ``others`` leave
    free (rounded), within 1..``limit``; growing needs ``UP_MARGIN`` more free core."""
    free = max(0.0, cores - others)
    want = max(1, min(limit, math.floor(free + 0.5)))
    if want > current and free < want - 0.5 + UP_MARGIN:
        return current
    return want


def read_sample(cpus: frozenset[int], clock: Callable[[], float] = time.monotonic) -> CpuSample:
    """The current ``CpuSample`` of ``cpus`` (busy 0 where /proc/stat is missing)."""
    tick = os.sysconf("SC_CLK_TCK")
    busy = 0
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        name, _, rest = line.partition(" ")
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            cols = rest.split()
            busy += sum(int(cols[i]) for i in _BUSY_COLUMNS if i < len(cols))
    t = os.times()
    return CpuSample(wall=clock(), busy=busy / tick, own=t.user + t.system)


class ThreadPolicy:
    """Sets the step thread's torch threads at start and, when adaptive, before steps.

    Args:
        num_threads: ``engine_core.num_threads`` (0 = torch's default, as it was when
            this module was imported, capped at the cgroup's CPU quota).
        policy: ``adaptive`` or ``fixed`` (``engine_core.thread_policy``).
        on_cpu: the engine computes on the CPU (adaptive does nothing on a GPU).
        clock: monotonic seconds.
        sampler: reads a ``CpuSample`` of the given CPUs (tests pass their own).
        quota: reads the cgroup's CPU quota (``cpu_quota``; tests pass their own).

    Raises:
        ValueError: an unknown policy.
    """

    def __init__(
        self,
        num_threads: int,
        policy: str,
        on_cpu: bool,
        clock: Callable[[], float] = time.monotonic,
        sampler: Callable[[frozenset[int]], CpuSample] | None = None,
        quota: Callable[[], float | None] = cpu_quota,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"thread_policy {policy!r}: use one of {', '.join(POLICIES)}")
        self.quota = quota()
        self.limit = (
            num_threads if num_threads > 0 else default_threads(self.quota, DEFAULT_THREADS)
        )
        torch.set_num_threads(self.limit)
        self.current = self.limit
        self.policy = policy
        self.adaptive = policy == "adaptive" and on_cpu and self.limit > 1
        self.cpus = frozenset(os.sched_getaffinity(0))
        self.clock = clock
        self.sampler = sampler or (lambda cpus: read_sample(cpus, clock))
        self.changes = 0
        self._last = self.sampler(self.cpus) if self.adaptive else None
        logger.info(
            "torch threads: %d on %d CPUs (cgroup quota %s), policy %s",
            self.limit, len(self.cpus), self.quota or "none", self.describe(),
        )  # fmt: skip

    def describe(self) -> str:
        """``2 adaptive`` style: the threads now and the policy in force."""
        return f"{self.current} {'adaptive' if self.adaptive else 'fixed'}"

    def before_step(self) -> None:
        """Re-check the co-tenants at most once per interval; resize the pool if needed."""
        if self._last is None or self.clock() - self._last.wall < CHECK_INTERVAL_S:
            return
        sample = self.sampler(self.cpus)
        others = others_busy(self._last, sample)
        self._last = sample
        want = choose_threads(len(self.cpus), others, self.current, self.limit)
        if want != self.current:
            logger.info(
                "other processes keep %.2f of %d CPUs busy: torch threads %d -> %d",
                others, len(self.cpus), self.current, want,
            )  # fmt: skip
            torch.set_num_threads(want)
            self.current = want
            self.changes += 1
