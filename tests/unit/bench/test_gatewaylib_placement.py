"""bench.gatewaylib.placement: the CPU split and the CPU time of a process tree."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time

import pytest

from bench.gatewaylib.placement import process_cpu_seconds, split_cpus


def test_split_cpus_gives_the_engine_the_first_cores_and_keeps_one_for_the_rest() -> None:
    mine = sorted(os.sched_getaffinity(0))
    assert split_cpus(0) is None
    assert split_cpus(0, 0) is None
    with pytest.raises(SystemExit, match="needs at least one left"):
        split_cpus(len(mine))
    with pytest.raises(SystemExit, match="needs at least one left"):
        split_cpus(0, len(mine))
    if len(mine) < 2:
        pytest.skip("one CPU: nothing to split")
    split = split_cpus(1)
    assert split is not None
    assert split.engine == {mine[0]}
    assert split.rest == set(mine[1:])
    assert split.proxy is None  # no cores of their own: the proxies run on the rest's
    split = split_cpus(0, 1)
    assert split is not None
    assert split.proxy == {mine[-1]}  # the proxies take the last core
    assert split.rest == set(mine[:-1])
    assert split.engine is None
    assert not split.proxy & split.rest
    if len(mine) >= 3:
        split = split_cpus(1, 1)
        assert split is not None
        assert (split.engine, split.proxy, split.rest) == ({mine[0]}, {mine[-1]}, set(mine[1:-1]))
    with pytest.raises(SystemExit, match="needs at least one left"):
        split_cpus(1, len(mine) - 1)


def test_process_cpu_seconds_grows_with_work_and_is_nan_for_no_process() -> None:
    before = process_cpu_seconds(os.getpid())
    sum(i * i for i in range(2_000_000))  # some CPU time of this process
    assert process_cpu_seconds(os.getpid()) > before
    assert math.isnan(process_cpu_seconds(2**31 - 1))  # no such process
    assert math.isnan(process_cpu_seconds(None))  # a side with no proxy process


def test_process_cpu_seconds_counts_the_child_processes() -> None:
    """A gateway with workers is charged its workers' CPU: a busy child's seconds are in
    its parent's figure while it runs."""
    spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < 30: pass"
    child = subprocess.Popen([sys.executable, "-c", spin])
    try:
        deadline = time.monotonic() + 20
        while process_cpu_seconds(child.pid) < 0.5 and time.monotonic() < deadline:
            time.sleep(0.05)
        own_alone = time.process_time()  # this process, without its children
        child_cpu = process_cpu_seconds(child.pid)
        assert child_cpu >= 0.5
        assert process_cpu_seconds(os.getpid()) >= own_alone + child_cpu - 0.05
    finally:
        child.kill()
        child.wait()
