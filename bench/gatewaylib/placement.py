"""Where ``bench.gateway_bench``'s processes run and the CPU time they use.

``--engine-cores N`` pins the engine to N CPUs (one torch thread each) and everything
else (Redis, the tokenizer service, the bare relay, the gateway, the client) to the
rest, as a deployment gives a proxy cores of its own. By default every process shares
every core, so each millisecond of gateway CPU during an engine step is taken from the
engine's threads and stretches that step for the whole batch: at concurrency 32 that,
not the gateway's latency, is most of what the gateway adds on a small machine.
``--proxy-cores N`` gives the gateway (with its workers) and the bare relay the last N
CPUs, so neither competes with the client, Redis or a stub engine for a core: what a
proxy with cores of its own adds (the two options combine when there are CPUs enough).
Children inherit the affinity ``bench.loadlib.spawn.on_cpus`` sets around their start.

The proxy's CPU time per request (user + system, from ``/proc/<pid>/stat``, every
thread of it and of its child processes) is reported per side: the gateway process's
on the gateway, HTTP, openai and curl sides, the bare relay's on the floor side. It
moves far less than latency on a shared machine, and every cycle of it competes with
the engine's own threads here. On the engine side it is the gateway's background work
during that run (health watch, stats polls), the baseline the gateway's sides include.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import NamedTuple


class CpuSplit(NamedTuple):
    """Where each part of the bench runs: the engine, the proxies in front of it (the
    gateway with its workers, the bare relay) and the rest (Redis, the tokenizer
    service, this client). None: no cores of its own, it runs on the rest's."""

    engine: set[int] | None
    proxy: set[int] | None
    rest: set[int]


def split_cpus(engine_cores: int, proxy_cores: int = 0) -> CpuSplit | None:
    """Split this process's CPUs: the engine gets the first ``engine_cores``, the
    proxies the last ``proxy_cores`` and the rest what lies between (at least one).
    None when both are 0 (every process shares every core)."""
    engine_cores, proxy_cores = max(0, engine_cores), max(0, proxy_cores)
    if not engine_cores and not proxy_cores:
        return None
    mine = sorted(os.sched_getaffinity(0))
    if engine_cores + proxy_cores >= len(mine):
        raise SystemExit(
            f"--engine-cores {engine_cores} --proxy-cores {proxy_cores}: this process may "
            f"use {len(mine)} CPU(s) and needs at least one left for Redis, the tokenizer "
            "and the client"
        )
    rest = set(mine[engine_cores : len(mine) - proxy_cores])
    return CpuSplit(
        engine=set(mine[:engine_cores]) if engine_cores else None,
        proxy=set(mine[len(mine) - proxy_cores :]) if proxy_cores else None,
        rest=rest,
    )


def process_cpu_seconds(pid: int | None) -> float:
    """User + system CPU seconds of process ``pid`` and its child processes so far (a
    gateway's workers), all their threads (Linux ``/proc``; NaN where there is none, or
    for no pid)."""
    if pid is None:
        return math.nan
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return math.nan
    fields = stat.rsplit(")", 1)[1].split()  # the name may hold spaces; it ends at ")"
    own = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    try:
        kids = [int(k) for k in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        kids = []
    return own + sum(c for c in map(process_cpu_seconds, kids) if not math.isnan(c))
