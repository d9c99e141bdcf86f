"""Latency the gateway adds: engine called directly vs through the gateway's gRPC front
and through its OpenAI-compatible HTTP front (SSE), side by side.

    python -m bench.gateway_bench [--rounds 3] [--requests-c1 16] [--requests-c32 64]
                                  [--max-tokens 16]

Starts Redis, tokenizer_svc, one engine replica and ``python -m gateway`` on
free ports, creates an unlimited tenant, then for concurrency 1 and 32 runs
the same greedy requests (same prompt tokens, ``max_tokens`` tokens,
ignore_eos) against the engine directly and through the gateway, in
alternating rounds so drift hits both sides alike. Per request it records
TTFT (send -> first token) and the mean inter-token time; per round the
p50/p99 of each; the report holds the median over rounds. The gateway side
includes everything the gateway does: auth (cached), tokenizer_svc Encode,
the Redis reserve/settle, routing, incremental detokenization. The "http"
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

Writes bench/reports/gateway_bench.json and .png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import platform
import secrets
import shutil
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
from tqdm import tqdm

from bench.report import save_report
from common.config import default_model_dir
from common.procs import ManagedProcess
from llm.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    common_pb2,
    engine_pb2,
    engine_pb2_grpc,
    gateway_pb2,
    gateway_pb2_grpc,
)
from ratelimit.testing import RedisServer, free_port
from tokenizer_svc.tokenizer import TextTokenizer

PROMPT = "Write a short poem about the sea and the wind, in four lines."
SIDES = ["engine", "gateway", "http", "openai"] + (["curl"] if shutil.which("curl") else [])
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


def pct(values: list[float], q: float) -> float:
    """The q-quantile (nearest rank) of ``values``."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


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


async def run_side(side: str, addresses: dict[str, str], key: str, ids: list[int],
                   num_requests: int, concurrency: int, max_tokens: int) -> list[Sample]:
    """``num_requests`` requests with ``concurrency`` in flight; one sample each."""
    async with grpc.aio.insecure_channel(addresses[side]) as channel:
        engine = engine_pb2_grpc.EngineStub(channel)
        gateway = gateway_pb2_grpc.GatewayStub(channel)

        async def one() -> Sample:
            if side == "engine":
                req = engine_pb2.EngineGenerateRequest(
                    request_id=f"bench-{secrets.token_hex(8)}", prompt_token_ids=ids,
                    sampling=engine_pb2.EngineSamplingParams(max_tokens=max_tokens,
                                                             ignore_eos=True))
                return await timed_stream(engine.Generate(req, timeout=300))
            sampling = common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
            greq = gateway_pb2.GenerateRequest(prompt=PROMPT, sampling=sampling)
            md = (("authorization", f"Bearer {key}"),)
            return await timed_stream(gateway.Generate(greq, metadata=md, timeout=300))

        return await limited(one, num_requests, concurrency)


def completions_body(max_tokens: int) -> dict[str, Any]:
    """The HTTP sides' request: the gateway side's, as ``POST /v1/completions``."""
    return {"model": "", "prompt": PROMPT, "max_tokens": max_tokens, "stream": True,
            "temperature": 0, "ignore_eos": True}


async def limited(one: Callable[[], Awaitable[Sample]], num_requests: int,
                  concurrency: int) -> list[Sample]:
    """``num_requests`` calls of ``one`` with at most ``concurrency`` in flight."""
    sem = asyncio.Semaphore(concurrency)

    async def gated() -> Sample:
        async with sem:
            return await one()

    return list(await asyncio.gather(*(gated() for _ in range(num_requests))))


async def run_http(base_url: str, key: str, num_requests: int, concurrency: int,
                   max_tokens: int) -> list[Sample]:
    """The gateway side's request through the HTTP front; one sample per request."""
    import aiohttp

    body = completions_body(max_tokens)
    headers = {"Authorization": f"Bearer {key}"}
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=0)) as session:

        async def one() -> Sample:
            t0 = time.perf_counter()
            stamps: list[float] = []
            async with session.post(f"{base_url}/v1/completions", json=body,
                                    headers=headers) as resp:
                resp.raise_for_status()
                async for line in resp.content:
                    if line.startswith(b"data: {") and _text_of(line[6:]):
                        stamps.append(time.perf_counter())
            return sample(t0, stamps, stamps)

        await one()  # untimed: opens the connection (a gRPC channel is open already too)
        return await limited(one, num_requests, concurrency)


def _text_of(data: bytes) -> str:
    choices = json.loads(data).get("choices") or [{}]
    return str(choices[0].get("text") or "")


async def run_curl(base_url: str, key: str, num_requests: int, concurrency: int,
                   max_tokens: int) -> list[Sample]:
    """The HTTP side through ``curl -N`` (when curl is on PATH): curl's own clock from
    the start of the transfer to the first response byte, which the HTTP front sends
    with the first text event (its headers go out with it). Curl reports no
    inter-event times, so both gap figures are NaN for this side."""
    body = json.dumps(completions_body(max_tokens))

    async def one() -> Sample:
        proc = await asyncio.create_subprocess_exec(
            "curl", "-sN", "-o", "/dev/null", "-w", "%{time_starttransfer}",
            "-H", f"Authorization: Bearer {key}", "-H", "Content-Type: application/json",
            "-d", body, f"{base_url}/v1/completions",
            stdout=asyncio.subprocess.PIPE)
        out, _ = await proc.communicate()
        first = float(out.decode() or "nan")
        return first, math.nan, math.nan, first

    return await limited(one, num_requests, concurrency)


async def run_openai(base_url: str, key: str, num_requests: int, concurrency: int,
                     max_tokens: int) -> list[Sample]:
    """The HTTP side again through the official ``openai`` client (httpx underneath)."""
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=f"{base_url}/v1", api_key=key, max_retries=0,
                           timeout=300) as client:

        async def one() -> Sample:
            t0 = time.perf_counter()
            stamps: list[float] = []
            stream = await client.completions.create(
                model="", prompt=PROMPT, max_tokens=max_tokens, stream=True,
                temperature=0, extra_body={"ignore_eos": True})
            async for event in stream:
                if event.choices and event.choices[0].text:
                    stamps.append(time.perf_counter())
            return sample(t0, stamps, stamps)

        await one()  # untimed: opens the connection
        return await limited(one, num_requests, concurrency)


def summarize(samples: list[Sample]) -> dict[str, float]:
    ttft = [s[0] * 1000 for s in samples]
    itl = [s[1] * 1000 for s in samples]
    event = [s[2] * 1000 for s in samples]
    first_text = [s[3] * 1000 for s in samples]
    if any(math.isnan(x) for x in itl):  # curl: no gaps
        itl = event = [math.nan]
    return {"ttft_p50_ms": pct(ttft, 0.5), "ttft_p99_ms": pct(ttft, 0.99),
            "itl_p50_ms": pct(itl, 0.5), "itl_p99_ms": pct(itl, 0.99),
            "event_gap_p50_ms": pct(event, 0.5), "event_gap_p99_ms": pct(event, 0.99),
            "first_text_p50_ms": pct(first_text, 0.5), "first_text_p99_ms": pct(first_text, 0.99)}


def start_stack(log_dir: Path, redis: RedisServer, admin_key: str
                ) -> tuple[list[ManagedProcess], dict[str, str]]:
    model_dir = str(default_model_dir())
    common = ["--port", "0", "--metrics-port", "0", "--log-format", "json"]
    tok = ManagedProcess(name="tokenizer", module="tokenizer_svc", log_dir=log_dir,
                         args=[*common, "--model-dir", model_dir]).start(60)
    eng = ManagedProcess(name="engine", module="engine_svc", log_dir=log_dir,
                         args=[*common, "--model-dir", model_dir, "--max-num-seqs", "32"],
                         env={"LLM_ENGINE_CORE_DEVICE": "cpu",
                              "LLM_ENGINE_CORE_DTYPE": "float32"}).start(300)
    http_port = free_port()
    gw = ManagedProcess(name="gateway", module="gateway", log_dir=log_dir,
                        args=[*common, "--engines", eng.address, "--tokenizer", tok.address,
                              "--redis-url", redis.url, "--log-level", "warning",
                              "--http-port", str(http_port)],
                        env={"ADMIN_KEY": admin_key}).start(120)
    return [gw, eng, tok], {"engine": eng.address, "gateway": gw.address,
                            "http": f"http://127.0.0.1:{http_port}"}


def make_key(address: str, admin_key: str) -> str:
    with grpc.insecure_channel(address) as ch:
        admin = admin_pb2_grpc.RateLimitAdminStub(ch)
        md = (("authorization", f"Bearer {admin_key}"),)
        admin.UpsertTenant(admin_pb2.Tenant(id="bench"), metadata=md)
        req = admin_pb2.CreateApiKeyRequest(tenant_id="bench", name="bench")
        return str(admin.CreateApiKey(req, metadata=md).key)


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = ["first_text_p50_ms", "first_text_p99_ms", "event_gap_p50_ms",
               "event_gap_p99_ms"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, conc in zip(axes, ("c1", "c32"), strict=True):
        res = report["results"][conc]
        xs = range(len(metrics))
        for i, (side, label) in enumerate((("engine", "engine"), ("gateway", "gateway gRPC"),
                                           ("http", "gateway HTTP (aiohttp client)"),
                                           ("openai", "gateway HTTP (openai client)"))):
            ax.bar([x + (i - 1.5) * 0.2 for x in xs], [res[side][m] for m in metrics], 0.2,
                   label=label)
        ax.set_xticks(list(xs), [m.replace("_ms", "") for m in metrics])
        ax.set_ylabel("ms")
        ax.set_title(f"concurrency {conc[1:]} (median of {report['rounds']} rounds)")
        ax.legend()
    fig.suptitle("Gateway added latency (2-core CPU box: noisy)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def measure(args: argparse.Namespace, addresses: dict[str, str], key: str,
            ids: list[int]) -> dict[str, Any]:
    runs = {"c1": (1, args.requests_c1), "c32": (32, args.requests_c32)}
    per_round: dict[str, dict[str, list[dict[str, float]]]] = {
        c: {name: [] for name in SIDES} for c in runs}
    with tqdm(total=args.rounds * len(runs) * len(SIDES), desc="gateway bench",
              unit="run") as bar:
        for r in range(args.rounds):
            for conc, (n_conc, n_req) in runs.items():
                k = r % len(SIDES)
                sides = SIDES[k:] + SIDES[:k]  # rotate so drift hits every side
                for name in sides:
                    samples = asyncio.run(
                        run_http(addresses["http"], key, n_req, n_conc, args.max_tokens)
                        if name == "http" else
                        run_openai(addresses["http"], key, n_req, n_conc, args.max_tokens)
                        if name == "openai" else
                        run_curl(addresses["http"], key, n_req, n_conc, args.max_tokens)
                        if name == "curl" else
                        run_side(name, addresses, key, ids, n_req, n_conc, args.max_tokens))
                    per_round[conc][name].append(summarize(samples))
                    bar.update(1)
    results: dict[str, Any] = {}
    for conc, by_side in per_round.items():
        med = {side: {m: statistics.median(r[m] for r in rounds) for m in rounds[0]}
               for side, rounds in by_side.items() if rounds}
        med["added"] = {m: med["gateway"][m] - med["engine"][m] for m in med["engine"]}
        for front in (f for f in ("http", "openai", "curl") if f in med):  # the HTTP front
            med[f"{front}_vs_grpc"] = {m: med[front][m] - med["gateway"][m]
                                       for m in ("first_text_p50_ms", "first_text_p99_ms",
                                                 "event_gap_p50_ms", "event_gap_p99_ms")}
        results[conc] = med
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests-c1", type=int, default=16)
    parser.add_argument("--requests-c32", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    admin_key = "sk-llm-" + secrets.token_urlsafe(32)
    ids = TextTokenizer(default_model_dir()).encode(PROMPT)
    with RedisServer() as redis:
        procs, addresses = start_stack(Path(tempfile.mkdtemp(prefix="gw-bench-")), redis,
                                       admin_key)
        try:
            key = make_key(addresses["gateway"], admin_key)
            asyncio.run(run_side("gateway", addresses, key, ids, 4, 4, 4))  # warm both paths
            asyncio.run(run_side("engine", addresses, key, ids, 4, 4, 4))
            asyncio.run(run_http(addresses["http"], key, 4, 4, 4))
            asyncio.run(run_openai(addresses["http"], key, 4, 4, 4))
            results = measure(args, addresses, key, ids)
        finally:
            for p in procs:
                p.stop()
    report = {"benchmark": "gateway_bench", "rounds": args.rounds, "max_tokens": args.max_tokens,
              "prompt_tokens": len(ids), "requests": {"c1": args.requests_c1,
                                                      "c32": args.requests_c32},
              "machine": {"python": platform.python_version(), "cpus": _cpus()},
              "note": "all services and the client share a 2-core CPU machine; figures are "
                      "noisy. added = gateway (gRPC) - engine (per token); http_vs_grpc and "
                      "openai_vs_grpc = HTTP front (aiohttp / openai client) - gRPC front, "
                      "time to the first text-bearing event and the gap between such events, "
                      "of the round medians (an SSE client sees text events only; the "
                      "incremental detokenizer holds back tokens that complete no character).",
              "results": results}
    save_report("gateway_bench", report, lambda path: plot(report, path))
    for conc, res in results.items():
        print(conc, json.dumps({k: {m: round(v, 2) for m, v in d.items()}
                                for k, d in res.items()}))


def _cpus() -> int:
    import os

    return os.cpu_count() or 0


if __name__ == "__main__":
    main()
