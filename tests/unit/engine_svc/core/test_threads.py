"""The step loop's thread policy: one thread per core that other processes leave free."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine_svc.core import threads
from engine_svc.core.threads import (
    CHECK_INTERVAL_S,
    CpuSample,
    ThreadPolicy,
    choose_threads,
    others_busy,
    read_sample,
)


def test_others_busy_is_the_busy_time_that_is_not_ours() -> None:
    a = CpuSample(wall=10.0, busy=100.0, own=40.0)
    # 2 s of wall: 3.6 CPU-s busy on our CPUs, 1.6 of it ours -> others kept 1 core busy
    assert others_busy(a, CpuSample(wall=12.0, busy=103.6, own=41.6)) == pytest.approx(1.0)
    # never negative (our own time counted on CPUs outside the set), nothing over no wall
    assert others_busy(a, CpuSample(wall=12.0, busy=100.0, own=42.0)) == 0.0
    assert others_busy(a, a) == 0.0


@pytest.mark.parametrize(
    ("others", "current", "want"),
    [
        (0.0, 2, 2),  # quiet: both cores
        (0.3, 2, 2),  # a little background work: keep both
        (0.67, 2, 1),  # a spinning neighbour's fair share while we run 2 threads
        (1.0, 2, 1),
        (1.0, 1, 1),  # the neighbour keeps its core: stay on one
        (0.4, 1, 1),  # free 1.6: not clearly two cores yet (no flapping)
        (0.1, 1, 2),  # the neighbour left
        (2.0, 2, 1),  # never fewer than one
    ],
)
def test_choose_threads_on_two_cores(others: float, current: int, want: int) -> None:
    assert choose_threads(2, others, current, limit=2) == want


def test_choose_threads_never_exceeds_the_start_up_pool() -> None:
    assert choose_threads(8, 0.0, 2, limit=2) == 2
    assert choose_threads(8, 3.2, 4, limit=8) == 5


def test_read_sample_counts_this_process() -> None:
    cpus = frozenset(os.sched_getaffinity(0))
    a = read_sample(cpus)
    sum(i * i for i in range(2_000_000))  # some CPU time of our own (clock ticks: 10 ms)
    b = read_sample(cpus)
    assert b.own > a.own
    assert b.busy >= a.busy
    assert b.wall > a.wall


class FakeCpu:
    """A clock and /proc/stat whose co-tenant load the test sets."""

    def __init__(self) -> None:
        self.now = 0.0
        self.busy = 0.0
        self.others = 0.0  # cores the co-tenant keeps busy from now on

    def advance(self, seconds: float) -> None:
        self.now += seconds
        self.busy += self.others * seconds

    def sample(self, cpus: frozenset[int]) -> CpuSample:
        return CpuSample(wall=self.now, busy=self.busy, own=0.0)


def _on_fresh_thread(body: Callable[[], None]) -> None:
    """torch.set_num_threads is per calling thread: run the policy on a thread of its
    own, as the engine runs it on its step thread, so this thread's count stays."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            body()
        except BaseException as e:  # re-raised on the test thread
            errors.append(e)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if errors:
        raise errors[0]


def test_the_policy_drops_to_one_thread_under_a_co_tenant_and_comes_back() -> None:
    if len(os.sched_getaffinity(0)) < 2:
        pytest.fail("this test needs two CPUs")

    def body() -> None:
        cpu = FakeCpu()
        policy = ThreadPolicy(2, "adaptive", True, clock=lambda: cpu.now, sampler=cpu.sample)
        cores = len(policy.cpus)
        assert (policy.current, torch.get_num_threads()) == (2, 2)
        assert policy.describe() == "2 adaptive"
        cpu.others = cores - 1.0  # all cores but one kept busy by a neighbour
        cpu.advance(CHECK_INTERVAL_S / 2)
        policy.before_step()  # too early to look again
        assert torch.get_num_threads() == 2
        cpu.advance(CHECK_INTERVAL_S)
        policy.before_step()
        assert (policy.current, torch.get_num_threads(), policy.changes) == (1, 1, 1)
        cpu.others = 0.0
        cpu.advance(CHECK_INTERVAL_S)
        policy.before_step()
        assert (policy.current, torch.get_num_threads(), policy.describe()) == (2, 2, "2 adaptive")
        cpu.others = cores - 1.0
        cpu.advance(CHECK_INTERVAL_S)
        policy.before_step()
        assert torch.get_num_threads() == 1
        # the next engine on this thread starts from the configured count, not the lowered one
        again = ThreadPolicy(2, "adaptive", True, clock=lambda: cpu.now, sampler=cpu.sample)
        assert (again.limit, torch.get_num_threads(), again.describe()) == (2, 2, "2 adaptive")

    _on_fresh_thread(body)


def test_the_default_count_is_torchs_own_before_any_engine_lowered_it() -> None:
    def body() -> None:
        torch.set_num_threads(1)  # as an earlier engine under a co-tenant leaves it
        policy = ThreadPolicy(0, "fixed", True)
        assert policy.limit == threads.DEFAULT_THREADS
        assert torch.get_num_threads() == threads.DEFAULT_THREADS

    _on_fresh_thread(body)


def test_fixed_and_gpu_policies_never_resize() -> None:
    def body() -> None:
        cpu = FakeCpu()
        cpu.others = 8.0
        for policy in (
            ThreadPolicy(2, "fixed", True, clock=lambda: cpu.now, sampler=cpu.sample),
            ThreadPolicy(2, "adaptive", False, clock=lambda: cpu.now, sampler=cpu.sample),
        ):
            cpu.advance(10 * CHECK_INTERVAL_S)
            policy.before_step()
            assert (torch.get_num_threads(), policy.describe()) == (2, "2 fixed")

    _on_fresh_thread(body)
    with pytest.raises(ValueError, match="thread_policy"):
        ThreadPolicy(0, "spin", True)


@pytest.mark.parametrize(
    ("files", "quota"),
    [
        ({"cpu.max": "max 100000\n"}, None),  # v2, no limit
        ({"cpu.max": "250000 100000\n"}, 2.5),  # v2: 2.5 CPUs
        ({"cpu.max": "50000\n"}, 0.5),  # v2 with the period left out (100 ms)
        ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),  # v1
        ({"cpu/cpu.cfs_quota_us": "200000", "cpu/cpu.cfs_period_us": "100000"}, 2.0),
        ({"cpu,cpuacct/cpu.cfs_quota_us": "150000", "cpu,cpuacct/cpu.cfs_period_us": "50000"}, 3.0),
        ({"cpu.max": "lots 100000"}, None),  # malformed: as none
        ({"cpu/cpu.cfs_quota_us": "200000"}, None),  # half of v1's pair
        ({}, None),  # no cgroup CPU controller
    ],
)
def test_cpu_quota_reads_cgroup_v2_and_v1(
    tmp_path: Path, files: dict[str, str], quota: float | None
) -> None:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert threads.cpu_quota(tmp_path) == quota


@pytest.mark.parametrize(
    ("quota", "torch_default", "want"),
    [(None, 64, 64), (2.0, 64, 2), (2.5, 64, 3), (0.5, 64, 1), (8.0, 4, 4)],
)
def test_the_default_thread_count_is_capped_at_the_quota(
    quota: float | None, torch_default: int, want: int
) -> None:
    assert threads.default_threads(quota, torch_default) == want


def test_a_quota_caps_the_default_pool_and_the_adaptive_growth() -> None:
    def body() -> None:
        cpu = FakeCpu()
        policy = ThreadPolicy(
            0, "adaptive", True, clock=lambda: cpu.now, sampler=cpu.sample, quota=lambda: 1.0
        )
        assert (policy.limit, torch.get_num_threads()) == (1, 1)
        cpu.advance(10 * CHECK_INTERVAL_S)  # an idle node: still the quota's one thread
        policy.before_step()
        assert torch.get_num_threads() == 1
        explicit = ThreadPolicy(2, "fixed", True, quota=lambda: 1.0)  # a configured count stands
        assert (explicit.limit, torch.get_num_threads()) == (2, 2)

    _on_fresh_thread(body)
