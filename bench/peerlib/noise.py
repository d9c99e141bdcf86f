"""The co-tenant of ``bench.peers --noise``: a fixed CPU burner beside a side.

One Python process spinning in a tight loop keeps one core busy, as a neighbour
pod would on a shared Kubernetes node. By default it is pinned to the last CPU
this process may use (the same core every run, so runs compare); ``pin=None``
leaves it to the kernel's scheduler. ``burner`` starts it before a side's
process and always stops it afterwards, by its own pid, and reports the share of
a core it really got (its CPU seconds over the wall time it ran).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from common.pgroup import stop_process_group

BURN = "while True:\n    pass\n"


def last_cpu() -> int:
    """The highest-numbered CPU this process may run on."""
    return max(os.sched_getaffinity(0))


def _cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` from /proc (0 where it cannot be read)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextmanager
def burner(pin: int | None) -> Iterator[dict[str, Any]]:
    """``with burner(pin) as facts: ...`` runs the burner for the block; after it,
    ``facts`` holds its pin, wall and CPU seconds and the share of a core it got."""
    proc = subprocess.Popen(
        [sys.executable, "-c", BURN],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        start_new_session=True,  # its own group: stopped by its pid, nothing else
    )
    facts: dict[str, Any] = {"pin": pin}
    t0 = time.perf_counter()
    try:
        if pin is not None:
            os.sched_setaffinity(proc.pid, {pin})
        yield facts
    finally:
        wall = time.perf_counter() - t0
        cpu = _cpu_seconds(proc.pid)
        stop_process_group(proc)
        facts.update(wall_s=wall, cpu_s=cpu, core_share=cpu / wall if wall > 0 else 0.0)


def falls(table: dict[str, dict[str, float]], suffix: str) -> dict[str, dict[str, float]]:
    """Per side with a noisy twin (label + ``suffix``): quiet tok/s over noisy tok/s
    per workload (2.0 = throughput halved under the burner)."""
    return {
        label: {w: row[w] / table[label + suffix][w] for w in row if w in table[label + suffix]}
        for label, row in table.items()
        if label + suffix in table
    }
