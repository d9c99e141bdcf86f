"""Latency the gateway adds: engine called directly vs through the gateway's gRPC front
and through its OpenAI-compatible HTTP front (SSE), side by side.

    python -m bench.gateway_bench [--rounds 3] [--requests-c1 16] [--requests-c32 64]
                                  [--max-tokens 16] [--pairs 100] [--engine model|stub]
                                  [--stub-first-token-ms 0] [--engine-cores 0]
                                  [--proxy-cores 0]

Starts Redis, tokenizer_svc, one engine replica and ``python -m gateway`` on
free ports, creates an unlimited tenant, then for concurrency 1 and 32 runs
the same greedy requests (same prompt tokens, ``max_tokens`` tokens,
ignore_eos) against the engine directly and through the gateway, in
alternating rounds so drift hits both sides alike. Per request it records
TTFT (send -> first token) and the mean inter-token time; per round the
p50/p99 of each; the report holds each side's median over rounds, and what a
front adds is the median over rounds of that round's difference. The gateway side
includes everything the gateway does: auth (cached), tokenizing (in process),
the Redis calls (request unit + lease, then tokens; ``--unlimited-tenant``
skips the token call), routing, incremental detokenization, settling. The "http"
side is the same request as `POST /v1/completions` with `stream: true`
(aiohttp client, time to the first SSE event carrying text), and the same
again with the official ``openai`` client (httpx) and with ``curl -N`` (its
time to the first byte; no gaps), so http, openai and curl - gateway are
what the HTTP front adds over the gRPC front.

Inter-token time is measured two ways: per token (gRPC sides: a chunk with n
tokens counts n arrivals), and per text-bearing event, which is what a
streaming user sees and the only thing an SSE client can count (the
incremental detokenizer sends no event for a token that completes no
character). HTTP-vs-gRPC comparisons use the per-event figures of both.

Beside the client-side figures, the gateway's own view per concurrency: its stage
histograms (``gateway_stage_seconds``: auth, reserve, reserve_beside, encode, route, take; the
overhead before the engine attempt; its TTFT and time per output token), scraped
from its /metrics before and after each run, as count, mean and interpolated p50 /
p99 of what that run added.

The proxy's CPU time per request (user + system, from ``/proc/<pid>/stat``,
every thread of it) is reported per side too: the gateway process's on the
gateway, HTTP, openai and curl sides, the bare relay's on the floor side. It
moves far less than latency on a shared machine, and every cycle of it
competes with the engine's own threads here. On the engine side it is the
gateway's background work during that run (health watch, stats polls), the
baseline the gateway's sides include.

The ``floor`` side is a bare grpc.aio relay in front of the same engine
(``bench.gatewaylib.relay_floor``: the stack's own server set-up, one engine call per
request, headers with the first chunk, every chunk written back, nothing else). No
gRPC gateway in Python can add less than it, so ``floor - engine`` is the transport's
share of what the gateway adds (one more hop each way and its thread handoffs) and
``gateway - floor`` the gateway's own work on the request path; both are reported per
round and per pair.

``--engine stub`` runs the engine service with no model behind it
(``bench.gatewaylib.stub_engine``: its gRPC server, servicer and checks, tokens at
once) under both the direct side and the gateway. The paired difference is then the
gateway's cost alone, without the model's step-to-step jitter, and it includes what
a real prefill would hide: the first chunk waits for the admission's Redis answer.
It measures the proxy the way proxies publish their overhead (against a fake
upstream), never the stack's serving speed.

``--engine-cores N`` pins the engine to N CPUs (one torch thread each) and everything
else (Redis, the tokenizer service, the bare relay, the gateway, this client) to the
rest, as a deployment gives a proxy cores of its own. By default every process shares
every core, so each millisecond of gateway CPU during an engine step is taken from the
engine's threads and stretches that step for the whole batch: at concurrency 32 that,
not the gateway's latency, is most of what the gateway adds on a small machine.
``--proxy-cores N`` gives the gateway (with its workers) and the bare relay the last N
CPUs, so neither competes with the client, Redis or a stub engine for a core: what a
proxy with cores of its own adds (the two options combine when there are CPUs enough).

Writes bench/reports/gateway_bench.json and .png.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import os
import platform
import secrets
import shutil
import statistics
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import grpc
from tqdm import tqdm

from bench.loadlib.spawn import Stack, StackSpec, admin_client, on_cpus, tenant_key
from bench.loadlib.stats import percentile
from bench.report import save_report
from common.config import default_model_dir
from common.redis_server import free_port
from llm.v1 import (
    admin_pb2,
    common_pb2,
    engine_pb2,
    engine_pb2_grpc,
    gateway_pb2,
    gateway_pb2_grpc,
)
from tokenizer_svc.tokenizer import TextTokenizer

# Sent raw (no chat template). Its greedy continuation is text from the first token on:
# without the trailing blank line the model's first token is <|im_end|>, which the
# detokenizer drops, so every "first text" figure would hold one decode step more than
# TTFT and every "event gap" two tokens.
PROMPT = "Write a short poem about the sea and the wind, in four lines.\n\n"
SIDES = ["engine", "floor", "gateway", "http", "openai"] + (
    ["curl"] if shutil.which("curl") else []
)
# seconds: time to the first token, mean gap per token, mean gap per text event, time to
# the first text event
Sample = tuple[float, float, float, float]


def sample(t0: float, token_stamps: list[float], event_stamps: list[float]) -> Sample:
    """TTFT to the first token and to the first text event, and the mean gaps between
    tokens and between events."""

    def gap(stamps: list[float]) -> float:
        return (stamps[-1] - stamps[0]) / max(1, len(stamps) - 1)

    events = event_stamps or token_stamps
    return token_stamps[0] - t0, gap(token_stamps), gap(events), events[0] - t0


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


async def timed_stream(stream: Any) -> Sample:
    t0 = time.perf_counter()
    stamps: list[float] = []
    events: list[float] = []
    async for chunk in stream:
        now = time.perf_counter()
        stamps.extend(now for _ in chunk.token_ids)
        if chunk.token_ids and getattr(chunk, "text", "x"):  # engine chunks carry no text
            events.append(now)
    return sample(t0, stamps, events)


OneRequest = Callable[[], Awaitable[Sample]]


@contextlib.asynccontextmanager
async def side_client(
    side: str,
    addresses: dict[str, str],
    key: str,
    ids: list[int],
    max_tokens: int,
    connections: int = 1,
) -> AsyncIterator[OneRequest]:
    """A client for ``side`` (its channel or session open, one untimed request done
    where the side keeps a connection), yielding the function that makes one timed
    request: ``engine``, ``floor`` (the bare relay) and ``gateway`` over gRPC; ``http``
    (aiohttp), ``openai`` (the official client, httpx) and ``curl`` (``curl -N``) through
    the HTTP front. The gRPC sides spread their requests over ``connections`` channels,
    each its own TCP connection (as many clients, or Envoy's per-thread upstream
    connections, would), so a gateway's workers all get some."""
    if side in ("engine", "floor", "gateway"):
        async with contextlib.AsyncExitStack() as stack:
            own = [("grpc.use_local_subchannel_pool", 1)] if connections > 1 else []
            channels = [
                await stack.enter_async_context(grpc.aio.insecure_channel(addresses[side], own))
                for _ in range(connections)
            ]
            ones = [_grpc_one(side, ch, key, ids, max_tokens) for ch in channels]
            turn = itertools.count()
            for one in ones[1:]:
                await one()  # opens that channel's connection (the first opens on its own)

            async def spread() -> Sample:
                return await ones[next(turn) % len(ones)]()

            yield spread if connections > 1 else ones[0]
    elif side == "http":
        import aiohttp

        async with aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=300), connector=aiohttp.TCPConnector(limit=0)
        ) as session:
            one = _aiohttp_one(session, addresses["http"], key, max_tokens)
            await one()  # opens the connection (a gRPC channel is open already too)
            yield one
    elif side == "openai":
        from openai import AsyncOpenAI

        async with AsyncOpenAI(
            base_url=f"{addresses['http']}/v1", api_key=key, max_retries=0, timeout=300
        ) as client:
            one = _openai_one(client, max_tokens)
            await one()
            yield one
    elif side == "curl":
        yield _curl_one(addresses["http"], key, max_tokens)
    else:
        raise ValueError(f"unknown side {side!r}")


def _grpc_one(
    side: str, channel: grpc.aio.Channel, key: str, ids: list[int], max_tokens: int
) -> OneRequest:
    engine = engine_pb2_grpc.EngineStub(channel)
    gateway = gateway_pb2_grpc.GatewayStub(channel)

    async def one() -> Sample:
        if side == "engine":
            req = engine_pb2.EngineGenerateRequest(
                request_id=f"bench-{secrets.token_hex(8)}",
                prompt_token_ids=ids,
                sampling=engine_pb2.EngineSamplingParams(max_tokens=max_tokens, ignore_eos=True),
            )
            return await timed_stream(engine.Generate(req, timeout=300))
        sampling = common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        greq = gateway_pb2.GenerateRequest(prompt=PROMPT, sampling=sampling)
        md = (("authorization", f"Bearer {key}"),)
        return await timed_stream(gateway.Generate(greq, metadata=md, timeout=300))

    return one


def completions_body(max_tokens: int) -> dict[str, Any]:
    """The HTTP sides' request: the gateway side's, as ``POST /v1/completions``."""
    return {
        "model": "",
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "stream": True,
        "temperature": 0,
        "ignore_eos": True,
    }


def _aiohttp_one(session: Any, base_url: str, key: str, max_tokens: int) -> OneRequest:
    body = completions_body(max_tokens)
    headers = {"Authorization": f"Bearer {key}"}

    async def one() -> Sample:
        t0 = time.perf_counter()
        stamps: list[float] = []
        async with session.post(f"{base_url}/v1/completions", json=body, headers=headers) as resp:
            resp.raise_for_status()
            async for line in resp.content:
                if line.startswith(b"data: {") and _text_of(line[6:]):
                    stamps.append(time.perf_counter())
        return sample(t0, stamps, stamps)

    return one


def _text_of(data: bytes) -> str:
    choices = json.loads(data).get("choices") or [{}]
    return str(choices[0].get("text") or "")


def _curl_one(base_url: str, key: str, max_tokens: int) -> OneRequest:
    """curl's own clock from the start of the transfer to the first response byte,
    which the HTTP front sends with the first text event (its headers go out with
    it). Curl reports no inter-event times, so both gap figures are NaN."""
    body = json.dumps(completions_body(max_tokens))

    async def one() -> Sample:
        proc = await asyncio.create_subprocess_exec(
            "curl",
            "-sN",
            "-o",
            "/dev/null",
            "-w",
            "%{time_starttransfer}",
            "-H",
            f"Authorization: Bearer {key}",
            "-H",
            "Content-Type: application/json",
            "-d",
            body,
            f"{base_url}/v1/completions",
            stdout=asyncio.subprocess.PIPE,
        )
        out, _ = await proc.communicate()
        first = float(out.decode() or "nan")
        return first, math.nan, math.nan, first

    return one


def _openai_one(client: Any, max_tokens: int) -> OneRequest:
    async def one() -> Sample:
        t0 = time.perf_counter()
        stamps: list[float] = []
        stream = await client.completions.create(
            model="",
            prompt=PROMPT,
            max_tokens=max_tokens,
            stream=True,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        async for event in stream:
            if event.choices and event.choices[0].text:
                stamps.append(time.perf_counter())
        return sample(t0, stamps, stamps)

    return one


async def limited(one: OneRequest, num_requests: int, concurrency: int) -> list[Sample]:
    """``num_requests`` calls of ``one`` with at most ``concurrency`` in flight."""
    sem = asyncio.Semaphore(concurrency)

    async def gated() -> Sample:
        async with sem:
            return await one()

    return list(await asyncio.gather(*(gated() for _ in range(num_requests))))


async def run_side(
    side: str,
    addresses: dict[str, str],
    key: str,
    ids: list[int],
    num_requests: int,
    concurrency: int,
    max_tokens: int,
    connections: int = 1,
) -> list[Sample]:
    """``num_requests`` requests with ``concurrency`` in flight; one sample each."""
    async with side_client(side, addresses, key, ids, max_tokens, connections) as one:
        return await limited(one, num_requests, concurrency)


async def run_paired(
    sides: list[str],
    addresses: dict[str, str],
    key: str,
    ids: list[int],
    num_pairs: int,
    max_tokens: int,
    cpu_pids: Mapping[str, int] | None = None,
) -> tuple[dict[str, list[Sample]], dict[str, float]]:
    """Concurrency 1, one request per side back to back, ``num_pairs`` times, the order
    rotated each time: the sides of one pair meet the same machine state, so their
    difference is the front's cost with most of the machine's drift taken out.

    Returns the samples and, per side, the CPU ms per request of the process
    ``cpu_pids`` names for it (read around each request; NaN for a side it does not
    name)."""
    async with contextlib.AsyncExitStack() as stack:
        ones = {
            s: await stack.enter_async_context(side_client(s, addresses, key, ids, max_tokens))
            for s in sides
        }
        out: dict[str, list[Sample]] = {s: [] for s in sides}
        pids = cpu_pids or {}
        cpu = dict.fromkeys(sides, 0.0)
        for i in range(num_pairs):
            k = i % len(sides)
            for s in sides[k:] + sides[:k]:
                c0 = process_cpu_seconds(pids.get(s))
                out[s].append(await ones[s]())
                cpu[s] += process_cpu_seconds(pids.get(s)) - c0
        per_request = {s: cpu[s] / num_pairs * 1000 if num_pairs else math.nan for s in sides}
        return out, per_request


def round_differences(
    side: list[dict[str, float]], base: list[dict[str, float]], keys: Sequence[str] = ()
) -> dict[str, float]:
    """Median over rounds of ``side`` minus ``base`` in each figure (``keys``, or all of
    ``base``'s). The sides of one round run back to back, so a round's difference meets
    one machine state; at concurrency 32 a side's TTFT moves by whole engine steps from
    round to round, which a difference of medians taken over all rounds would keep."""
    return {
        m: statistics.median(a[m] - b[m] for a, b in zip(side, base, strict=True))
        for m in (keys or base[0])
    }


def paired_differences(
    samples: dict[str, list[Sample]], base: str, field: int
) -> dict[str, dict[str, float]]:
    """p1/p10/p50/p90/p99 (ms) of each side's per-pair difference from ``base`` in one
    field of the samples (0 = time to the first token, 3 = to the first text event).
    Tails as long on the low side as on the high one are the machine's noise (the
    engine's next step starting before one side of a pair and after the other), not
    the front's cost."""
    out = {}
    for side, rows in samples.items():
        if side == base:
            continue
        diffs = [(a[field] - b[field]) * 1000 for a, b in zip(rows, samples[base], strict=True)]
        out[side] = {
            "p1_ms": percentile(diffs, 1),
            "p10_ms": percentile(diffs, 10),
            "p50_ms": percentile(diffs, 50),
            "p90_ms": percentile(diffs, 90),
            "p99_ms": percentile(diffs, 99),
        }
    return out


# the gateway's histograms of its own time, by what the report calls them
STAGE_SERIES = {
    **{
        stage: ("gateway_stage_seconds", {"stage": stage})
        for stage in ("auth", "reserve", "reserve_beside", "encode", "route", "take")
    },
    "overhead (to the engine attempt)": ("gateway_overhead_seconds", {}),
    "ttft (gateway's view)": ("gateway_time_to_first_token_seconds", {}),
    "time per output token": ("gateway_time_per_output_token_seconds", {}),
}
Histo = tuple[float, float, dict[float, float]]  # count, sum, cumulative bucket counts


def scrape_histograms(metrics_url: str) -> dict[str, Histo]:
    """The STAGE_SERIES histograms on a /metrics page, summed over their other labels."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(metrics_url, timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, Histo] = {}
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for label, (name, match) in STAGE_SERIES.items():
        count = total = 0.0
        buckets: dict[float, float] = {}
        fam = families.get(name)
        for smp in fam.samples if fam is not None else ():
            if any(smp.labels.get(k) != v for k, v in match.items()):
                continue
            if smp.name.endswith("_count"):
                count += smp.value
            elif smp.name.endswith("_sum"):
                total += smp.value
            elif smp.name.endswith("_bucket"):
                le = float(smp.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + smp.value
        out[label] = (count, total, buckets)
    return out


def histogram_quantile(q: float, buckets: dict[float, float]) -> float:
    """Prometheus' histogram_quantile over cumulative buckets (linear in a bucket)."""
    edges = sorted(buckets)
    if not edges or buckets[edges[-1]] <= 0:
        return math.nan
    rank = q * buckets[edges[-1]]
    lower, below = 0.0, 0.0
    for le in edges:
        if buckets[le] >= rank:
            if math.isinf(le):
                return lower
            width = buckets[le] - below
            return lower + (le - lower) * ((rank - below) / width if width else 0.0)
        lower, below = le, buckets[le]
    return lower


def add_delta(
    acc: dict[str, Histo], before: dict[str, Histo], after: dict[str, Histo]
) -> dict[str, Histo]:
    """``acc`` plus what the histograms gained between two scrapes."""
    out = {}
    for label, (count, total, buckets) in after.items():
        c0, t0, b0 = before.get(label, (0.0, 0.0, {}))
        a_count, a_total, a_buckets = acc.get(label, (0.0, 0.0, {}))
        out[label] = (
            a_count + count - c0,
            a_total + total - t0,
            {le: a_buckets.get(le, 0.0) + v - b0.get(le, 0.0) for le, v in buckets.items()},
        )
    return out


def stage_figures(histos: dict[str, Histo]) -> dict[str, dict[str, float]]:
    """Count, mean, p50 and p99 (ms) of each histogram."""
    return {
        label: {
            "count": n,
            "mean_ms": total / n * 1000 if n else math.nan,
            "p50_ms": histogram_quantile(0.5, buckets) * 1000,
            "p99_ms": histogram_quantile(0.99, buckets) * 1000,
        }
        for label, (n, total, buckets) in histos.items()
    }


def summarize(samples: list[Sample], proxy_cpu_s: float = math.nan) -> dict[str, float]:
    """Quantiles of one run's samples (ms), and the proxy's CPU ms per request in it
    (``proxy_cpu_s``: what the process in front of the engine used during the run)."""
    ttft = [s[0] * 1000 for s in samples]
    itl = [s[1] * 1000 for s in samples]
    event = [s[2] * 1000 for s in samples]
    first_text = [s[3] * 1000 for s in samples]
    if any(math.isnan(x) for x in itl):  # curl: no gaps
        itl = event = [math.nan]
    return {
        "ttft_p50_ms": percentile(ttft, 50),
        "ttft_p99_ms": percentile(ttft, 99),
        "itl_p50_ms": percentile(itl, 50),
        "itl_p99_ms": percentile(itl, 99),
        "event_gap_p50_ms": percentile(event, 50),
        "event_gap_p99_ms": percentile(event, 99),
        "first_text_p50_ms": percentile(first_text, 50),
        "first_text_p99_ms": percentile(first_text, 99),
        "proxy_cpu_ms_per_request": proxy_cpu_s / max(1, len(samples)) * 1000,
    }


ENGINE_MODULES = {"model": "engine_svc", "stub": "bench.gatewaylib.stub_engine"}


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


def start_stack(
    log_dir: Path,
    engine_dtype: str = "float32",
    engine: str = "model",
    stub_first_token_ms: float = 0.0,
    engine_cpus: set[int] | None = None,
    gateway_workers: int = 1,
    proxy_cpus: set[int] | None = None,
) -> tuple[Stack, dict[str, str]]:
    """Redis, tokenizer, engine, gateway and bare relay on free ports
    (``bench.loadlib.spawn.Stack``), and the address of each side. With ``engine_cpus``
    the engine runs on those CPUs alone, one torch thread per CPU; with ``proxy_cpus``
    the bare relay and the gateway (its workers inherit them) on those; the rest
    inherit the caller's affinity."""
    model_dir = str(default_model_dir())
    spec = StackSpec(
        Path(model_dir),
        log_dir,
        gateway=True,
        engine_module=ENGINE_MODULES[engine],
        engine_env={
            "LLM_ENGINE_CORE_DEVICE": "cpu",
            "LLM_ENGINE_CORE_DTYPE": engine_dtype,
            "STUB_FIRST_TOKEN_MS": str(stub_first_token_ms),
        },
        engine_args=["--max-num-seqs", "32"],
        gateway_env={},
        gateway_args=["--log-level", "warning", "--workers", str(gateway_workers)],
        http_port=free_port(),
        engine_cpus=engine_cpus,
        proxy_cpus=proxy_cpus,
    )
    stack = Stack(spec).start()
    try:
        relay = ["--engine", stack.engines[0], "--model-dir", model_dir]
        floor = stack.service("floor", "bench.gatewaylib.relay_floor", relay, proxy=True)
    except BaseException:
        stack.stop()
        raise
    return stack, {
        "engine": stack.engines[0],
        "floor": floor.address,
        "gateway": stack.gateway,
        "http": stack.http,
        "gateway_metrics": stack.metrics_url("bench-gateway"),
    }


# far above what the bench asks for, so nothing is denied, but every limit is checked:
# the request unit and lease before tokenizing, the tokens after (two Redis calls)
BENCH_LIMITS = admin_pb2.LimitPolicy(
    requests_per_minute=1_000_000, tokens_per_minute=1_000_000_000, max_concurrent=10_000
)


def make_key(address: str, admin_key: str, limited: bool = True) -> str:
    """An API key of the bench tenant: with ``BENCH_LIMITS``, or with no limit at all
    (then the gateway skips the token check: one Redis call before the engine)."""
    limits = BENCH_LIMITS if limited else admin_pb2.LimitPolicy()
    with admin_client(address) as admin:
        return tenant_key(admin, admin_key, admin_pb2.Tenant(id="bench", limits=limits))


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = ["first_text_p50_ms", "first_text_p99_ms", "event_gap_p50_ms", "event_gap_p99_ms"]
    paired = report["results"].get("c1_paired")
    fig, axes = plt.subplots(1, 3 if paired else 2, figsize=(16 if paired else 11, 4))
    if paired:
        ax = axes[-1]
        rows = {
            "gateway - engine\n(first token)": paired["gateway_minus_engine_ttft"]["gateway"],
            "bare relay - engine\n(first token)": paired["floor_minus_engine_ttft"]["floor"],
            "gateway - bare relay\n(first token)": paired["gateway_minus_floor_ttft"]["gateway"],
            **{
                f"{side} - gRPC front\n(first text)": d
                for side, d in paired["front_minus_grpc_first_text"].items()
                if side != "gateway"
            },
        }
        xs = range(len(rows))
        for i, q in enumerate(("p50_ms", "p90_ms", "p99_ms")):
            ax.bar(
                [x + (i - 1) * 0.25 for x in xs],
                [d[q] for d in rows.values()],
                0.25,
                label=q.replace("_ms", ""),
            )
        ax.axhline(0, color="black", linewidth=0.5)
        ax.set_xticks(list(xs), list(rows), fontsize=7, rotation=25, ha="right")
        ax.set_ylabel("ms added")
        ax.set_title(f"concurrency 1, {paired['pairs']} paired requests")
        ax.legend()
    for ax, conc in zip(axes, ("c1", "c32"), strict=False):
        res = report["results"][conc]
        xs = range(len(metrics))
        for i, (side, label) in enumerate(
            (
                ("engine", "engine"),
                ("floor", "bare grpc.aio relay"),
                ("gateway", "gateway gRPC"),
                ("http", "gateway HTTP (aiohttp client)"),
                ("openai", "gateway HTTP (openai client)"),
            )
        ):
            ax.bar(
                [x + (i - 2) * 0.16 for x in xs], [res[side][m] for m in metrics], 0.16, label=label
            )
        ax.set_xticks(list(xs), [m.replace("_ms", "") for m in metrics])
        ax.set_ylabel("ms")
        ax.set_title(f"concurrency {conc[1:]} (median of {report['rounds']} rounds)")
        ax.legend()
    m = report.get("machine", {})
    placement = report.get("placement")
    where = (
        f"engine on CPU {placement['engine_cpus']}, proxies on "
        f"{placement['proxy_cpus']}, the rest on "
        f"{placement['others_cpus']}"
        if isinstance(placement, dict)
        else "every process on every core"
    )
    fig.suptitle(
        f"Gateway added latency, {report.get('engine', 'model')} engine: "
        f"{m.get('cpu', '?')}, {m.get('cores', '?')} cores, {where}, "
        f"{report.get('gateway_workers', 1)} gateway worker(s), "
        f"{report.get('connections_c32', 1)} connection(s) at 32, "
        f"load {m.get('loadavg_at_save', [math.nan])[0]:.1f}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def measure(
    args: argparse.Namespace,
    addresses: dict[str, str],
    key: str,
    ids: list[int],
    cpu_pids: Mapping[str, int] | None = None,
) -> dict[str, Any]:
    runs = {"c1": (1, args.requests_c1), "c32": (32, args.requests_c32)}
    per_round: dict[str, dict[str, list[dict[str, float]]]] = {
        c: {name: [] for name in SIDES} for c in runs
    }
    metrics_url = addresses["gateway_metrics"]
    stages: dict[str, dict[str, Histo]] = {}  # per concurrency: what its runs added
    with tqdm(total=args.rounds * len(runs) * len(SIDES), desc="gateway bench", unit="run") as bar:
        for r in range(args.rounds):
            for conc, (n_conc, n_req) in runs.items():
                k = r % len(SIDES)
                sides = SIDES[k:] + SIDES[:k]  # rotate so drift hits every side
                before = scrape_histograms(metrics_url)
                for name in sides:
                    pid = (cpu_pids or {}).get(name)
                    c0 = process_cpu_seconds(pid)
                    samples = asyncio.run(
                        run_side(
                            name,
                            addresses,
                            key,
                            ids,
                            n_req,
                            n_conc,
                            args.max_tokens,
                            args.connections if n_conc > 1 else 1,
                        )
                    )
                    cpu = process_cpu_seconds(pid) - c0
                    per_round[conc][name].append(summarize(samples, cpu))
                    bar.update(1)
                after = scrape_histograms(metrics_url)
                stages[conc] = add_delta(stages.get(conc, {}), before, after)
    results: dict[str, Any] = {}
    for conc, by_side in per_round.items():
        med = {
            side: {m: statistics.median(r[m] for r in rounds) for m in rounds[0]}
            for side, rounds in by_side.items()
            if rounds
        }
        med["added"] = round_differences(by_side["gateway"], by_side["engine"])
        # what one more grpc.aio hop costs, and the gateway's own work above it
        med["floor_added"] = round_differences(by_side["floor"], by_side["engine"])
        med["gateway_vs_floor"] = round_differences(by_side["gateway"], by_side["floor"])
        for front in (f for f in ("http", "openai", "curl") if f in med):  # the HTTP front
            med[f"{front}_vs_grpc"] = round_differences(
                by_side[front],
                by_side["gateway"],
                ("first_text_p50_ms", "first_text_p99_ms", "event_gap_p50_ms", "event_gap_p99_ms"),
            )
        results[conc] = {
            **med,
            "gateway_stages": stage_figures(stages.get(conc, {})),
            "by_round": by_side,  # each side's figures per round, in round order
        }
    if args.pairs:
        paired, cpu_ms = asyncio.run(
            run_paired(SIDES, addresses, key, ids, args.pairs, args.max_tokens, cpu_pids)
        )
        fronts = {s: paired[s] for s in SIDES if s not in ("engine", "floor")}
        results["c1_paired"] = {
            "pairs": args.pairs,
            "sides": {s: summarize(rows) for s, rows in paired.items()},
            # the proxy's CPU per request of each side (engine: the gateway's background)
            "proxy_cpu_ms_per_request": cpu_ms,
            # the gRPC front over the engine: time to the first token
            "gateway_minus_engine_ttft": paired_differences(
                {"engine": paired["engine"], "gateway": paired["gateway"]}, "engine", 0
            ),
            # the bare relay over the engine (the transport's floor), and the gateway over
            # the bare relay (its own work on the request path): time to the first token
            "floor_minus_engine_ttft": paired_differences(
                {"engine": paired["engine"], "floor": paired["floor"]}, "engine", 0
            ),
            "gateway_minus_floor_ttft": paired_differences(
                {"floor": paired["floor"], "gateway": paired["gateway"]}, "floor", 0
            ),
            # each HTTP client over the gRPC front: time to the first text event
            "front_minus_grpc_first_text": paired_differences(fronts, "gateway", 3),
        }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests-c1", type=int, default=16)
    parser.add_argument("--requests-c32", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument(
        "--unlimited-tenant",
        action="store_true",
        help="a tenant with no limits (no token check: one Redis call)",
    )
    parser.add_argument(
        "--engine-dtype",
        default="float32",
        help="the engine's weight dtype (float32, as the tests; auto: its own choice, as "
        "`make run`). The engine's step-to-step jitter is the noise every paired "
        "difference carries",
    )
    parser.add_argument(
        "--engine",
        choices=sorted(ENGINE_MODULES),
        default="model",
        help="model: the real engine; stub: the engine service with no model behind it "
        "(tokens at once), so both sides differ by the gateway alone, without the "
        "model's jitter (bench.gatewaylib.stub_engine)",
    )
    parser.add_argument(
        "--stub-first-token-ms",
        type=float,
        default=0.0,
        help="with --engine stub: hold each first token this long (a prefill's wait, no "
        "CPU), so what the gateway overlaps with the engine's start is hidden as behind "
        "a real model",
    )
    parser.add_argument(
        "--pairs",
        type=int,
        default=100,
        help="concurrency-1 paired requests (every side back to back, order rotated); 0 = skip",
    )
    parser.add_argument(
        "--engine-cores",
        type=int,
        default=0,
        help="pin the engine to this many CPUs (one torch thread each) and Redis, the "
        "tokenizer, the bare relay, the gateway and this client to the rest, as a "
        "deployment gives a proxy cores of its own; 0 = everything shares every core",
    )
    parser.add_argument(
        "--proxy-cores",
        type=int,
        default=0,
        help="pin the gateway (and its workers) and the bare relay to this many CPUs of "
        "their own, the last ones, and the client, Redis and the tokenizer (and the "
        "engine, without --engine-cores) to the rest: the proxy's latency when it does "
        "not compete with the client for a core; 0 = no cores of its own",
    )
    parser.add_argument(
        "--gateway-workers",
        type=int,
        default=1,
        help="the gateway's worker processes ([gateway] workers; its CPU figures are "
        "the supervisor's and its workers' together)",
    )
    parser.add_argument(
        "--connections",
        type=int,
        default=1,
        help="at concurrency 32, the gRPC sides' requests spread over this many "
        "connections (workers share connections, not the streams of one)",
    )
    args = parser.parse_args()
    split = split_cpus(args.engine_cores, args.proxy_cores)
    loadavg_before = os.getloadavg()
    ids = TextTokenizer(default_model_dir()).encode(PROMPT)
    # this client, Redis and every later child on the others' CPUs (the engine's own
    # are set around its start)
    with on_cpus(split.rest if split else None):
        stack, addresses = start_stack(
            Path(tempfile.mkdtemp(prefix="gw-bench-")),
            args.engine_dtype,
            args.engine,
            args.stub_first_token_ms,
            split.engine if split else None,
            args.gateway_workers,
            split.proxy if split else None,
        )
        try:
            key = make_key(addresses["gateway"], stack.admin_key, not args.unlimited_tenant)
            for side in SIDES:  # warm every path
                asyncio.run(run_side(side, addresses, key, ids, 4, 4, 4))
            gw_proc, floor_proc = stack.procs["bench-gateway"].proc, stack.procs["floor"].proc
            assert gw_proc is not None  # started above
            assert floor_proc is not None
            # whose CPU each side is charged: the process in front of the engine there
            cpu_pids = {s: floor_proc.pid if s == "floor" else gw_proc.pid for s in SIDES}
            results = measure(args, addresses, key, ids, cpu_pids)
        finally:
            stack.stop()
    report = {
        "benchmark": "gateway_bench",
        "rounds": args.rounds,
        "max_tokens": args.max_tokens,
        "tenant_limits": "none" if args.unlimited_tenant else str(BENCH_LIMITS).strip(),
        "prompt_tokens": len(ids),
        "requests": {"c1": args.requests_c1, "c32": args.requests_c32},
        "machine": {"python": platform.python_version(), "loadavg_before": loadavg_before},
        "engine_dtype": args.engine_dtype,
        "engine": args.engine,
        "gateway_workers": args.gateway_workers,
        "connections_c32": args.connections,
        "stub_first_token_ms": args.stub_first_token_ms if args.engine == "stub" else None,
        "placement": (
            {
                "engine_cpus": sorted(split.engine or split.rest),
                "proxy_cpus": sorted(split.proxy or split.rest),
                "others_cpus": sorted(split.rest),
            }
            if split
            else "every process on every core"
        ),
        "note": "all services and the client on one machine (see placement and "
        "machine); figures are noisy. added = gateway (gRPC) - engine (per token); "
        "http_vs_grpc and openai_vs_grpc = HTTP front (aiohttp / openai client) - gRPC front, "
        "time to the first text-bearing event and the gap between such events; "
        "each is the median over rounds of that round's difference (an SSE client "
        "sees text events only; the incremental detokenizer holds back tokens that "
        "complete no character).",
        "results": results,
    }
    save_report("gateway_bench", report, lambda path: plot(report, path))
    for conc in ("c1", "c32"):
        res = {k: d for k, d in results[conc].items() if k not in ("gateway_stages", "by_round")}
        print(conc, json.dumps({k: {m: round(v, 2) for m, v in d.items()} for k, d in res.items()}))
        cpu = {s: results[conc][s]["proxy_cpu_ms_per_request"] for s in SIDES}
        print(
            f"  {conc} proxy CPU ms per request (floor: the bare relay's; engine: the "
            "gateway's background): " + "  ".join(f"{s} {v:.2f}" for s, v in cpu.items())
        )
        print(f"  {conc} gateway stages (its own histograms; ms):")
        for label, d in results[conc]["gateway_stages"].items():
            print(
                f"    {label:<34} n={d['count']:<5.0f} mean {d['mean_ms']:7.2f}  "
                f"p50 {d['p50_ms']:7.2f}  p99 {d['p99_ms']:7.2f}"
            )
    if "c1_paired" in results:
        p = results["c1_paired"]
        print(f"c1 paired ({p['pairs']} pairs), per-pair differences in ms:")
        for name, diffs in (
            ("gateway gRPC - engine, first token", p["gateway_minus_engine_ttft"]),
            ("bare relay (floor) - engine, first token", p["floor_minus_engine_ttft"]),
            ("gateway gRPC - bare relay (floor), first token", p["gateway_minus_floor_ttft"]),
            ("HTTP front - gRPC front, first text event", p["front_minus_grpc_first_text"]),
        ):
            for side, d in diffs.items():
                print(
                    f"  {name} [{side}]: p1 {d['p1_ms']:.2f}  p10 {d['p10_ms']:.2f}  "
                    f"p50 {d['p50_ms']:.2f}  p90 {d['p90_ms']:.2f}  p99 {d['p99_ms']:.2f}"
                )
        print(
            "  proxy CPU ms per request: "
            + "  ".join(f"{s} {v:.2f}" for s, v in p["proxy_cpu_ms_per_request"].items())
        )


if __name__ == "__main__":
    main()
