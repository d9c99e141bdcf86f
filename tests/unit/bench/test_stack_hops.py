"""bench.stack_hops without an engine: the per-hop figures and what each layer adds, the
HTTP hop's timing against a real loopback server speaking the OpenAI stream, the chart
and the argument checks."""

from __future__ import annotations

import asyncio
from pathlib import Path

import openai
import pytest
from aiohttp import web

from bench.report import machine_facts
from bench.stack_bench import timed_completion
from bench.stack_hops import parse_args, plot, summarize
from tests.unit.bench.test_stack_bench import FakeOpenAI


def _rows() -> list[dict[str, float]]:
    # seconds; the first row is a warm-up whose figures are far off and must not count
    return [
        {"tokens": 100, "grpc": 9.0, "http": 9.0, "inproc": 0.0},
        {"tokens": 100, "grpc": 0.100, "http": 0.104, "inproc": 0.090},
        {"tokens": 200, "grpc": 0.200, "http": 0.198, "inproc": 0.180},
        {"tokens": 400, "grpc": 0.400, "http": 0.410, "inproc": 0.395},
    ]


def test_summarize_gives_medians_of_each_hop_and_of_each_layers_share() -> None:
    got = summarize(_rows(), warmup=1)
    assert got["grpc_p50_ms"] == pytest.approx(200.0)
    assert got["http_p50_ms"] == pytest.approx(198.0)
    assert got["inproc_p50_ms"] == pytest.approx(180.0)
    # per prompt, then the median: http - grpc = 4, -2, 10 ms; grpc - inproc = 10, 20, 5 ms
    assert got["gateway_ms"] == pytest.approx(4.0)
    assert got["engine_service_ms"] == pytest.approx(10.0)
    assert got["ms_per_prompt_token"] == pytest.approx(0.9)  # 0.9, 0.9, 0.9875
    with pytest.raises(ValueError, match="warm-up"):
        summarize(_rows(), warmup=4)


def test_the_chart_is_written(tmp_path: Path) -> None:
    png = tmp_path / "hops.png"
    plot(_rows(), 1, machine_facts(), png)
    assert png.stat().st_size > 1000


def _ttft_from(fake: FakeOpenAI, prompt: str, max_tokens: int) -> float:
    """The HTTP hop's timing (stack_bench's timed_completion, as stack_hops calls it)
    through the openai client against ``fake`` on a loopback port."""

    async def run() -> float:
        app = web.Application()
        app.router.add_post("/v1/completions", fake.completions)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        port = runner.addresses[0][1]
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="sk-k")
        try:
            return (await timed_completion(client, "", prompt, max_tokens)).ttft_s
        finally:
            await client.close()
            await runner.cleanup()

    return asyncio.run(run())


def test_the_http_hop_times_the_first_chunk_with_text() -> None:
    fake = FakeOpenAI(hold_tokens=-1, hold=1)
    seconds = _ttft_from(fake, "a prompt", 3)
    assert seconds > 0  # a time was taken; how long is not asserted
    body = fake.bodies[0]
    assert (body["prompt"], body["max_tokens"], body["stream"]) == ("a prompt", 3, True)
    assert body["temperature"] == 0
    assert body["ignore_eos"] is True
    with pytest.raises(RuntimeError, match="no text"):  # a stream of no tokens
        _ttft_from(fake, "p", 0)


def test_arguments() -> None:
    args = parse_args(["--requests", "5", "--warmup", "1", "--prompt-tokens", "10-20"])
    assert (args.requests, args.warmup, args.prompt_tokens) == (5, 1, (10, 20))
    assert isinstance(args.seed, int)
    with pytest.raises(SystemExit):
        parse_args(["--requests", "2", "--warmup", "2"])
