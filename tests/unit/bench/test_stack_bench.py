"""bench.stack_bench without an engine: the prompts (their token lengths, the same texts
for both sides), the requests the openai client sends to a real loopback HTTP server
speaking the OpenAI stream, the figures and ratio, and the report's shape."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from bench import stack_bench
from bench.report import machine_facts, save_report
from bench.stack_bench import (
    FIGURES,
    OURS,
    STOCK,
    Prompt,
    build_report,
    make_workload,
    parse_args,
    plot,
    prompt_text,
    ratios,
    run_workload,
    summarize,
    summarize_phase,
)
from tokenizer_svc.tokenizer import TextTokenizer


@pytest.fixture(scope="module")
def tok(model_dir: Path) -> TextTokenizer:
    return TextTokenizer(model_dir)


def test_prompts_encode_to_their_drawn_lengths_and_repeat_only_with_the_seed(
    tok: TextTokenizer,
) -> None:
    wl = make_workload(tok, 7, requests_c1=5, streams=6, warmup=2, lengths=(64, 512))
    assert {k: len(v) for k, v in wl.items()} == {"warm_c1": 2, "warm_c16": 6, "c1": 5, "c16": 6}
    prompts = [p for ps in wl.values() for p in ps]
    for p in prompts:
        assert len(tok.encode(p.text)) == p.tokens
        assert 64 <= p.tokens <= 512
    assert len({p.text for p in prompts}) == len(prompts)  # no prefix cache helps
    assert make_workload(tok, 7, 5, 6, 2, (64, 512)) == wl
    assert make_workload(tok, 8, 5, 6, 2, (64, 512))["c1"] != wl["c1"]
    for n in (64, 512):  # both ends of the range
        assert len(tok.encode(prompt_text(tok, random.Random(n), n))) == n


class DroppingTokenizer:
    """Decoding drops every id divisible by 7, so a text can encode shorter than its ids."""

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(str(i) for i in ids if i % 7)

    def encode(self, text: str) -> list[int]:
        return [int(x) for x in text.split()]


def test_prompt_text_redraws_until_the_text_encodes_to_the_length() -> None:
    tok = DroppingTokenizer()
    text = prompt_text(tok, random.Random(1), 300)
    assert len(tok.encode(text)) == 300

    class Never(DroppingTokenizer):
        def encode(self, text: str) -> list[int]:
            return [1]

    with pytest.raises(RuntimeError, match="300 tokens"):
        prompt_text(Never(), random.Random(1), 300, tries=3)


class FakeOpenAI:
    """GET /v1/models and a streamed POST /v1/completions: one text chunk per token
    (the first one empty), then a usage chunk unless ``usage`` is off. A request of
    ``hold_tokens`` waits until ``hold`` of them are in flight (10 s at most: then the
    test fails), so a burst that is not concurrent cannot pass."""

    def __init__(self, hold_tokens: int, hold: int, usage: bool = True) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.keys: set[str] = set()
        self.hold_tokens, self.hold, self.usage = hold_tokens, hold, usage
        self.in_flight = 0
        self.all_in = asyncio.Event()

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m", "object": "model"}]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.keys.add(request.headers["Authorization"])
        n = body["max_tokens"]
        if n == self.hold_tokens:
            self.in_flight += 1
            if self.in_flight == self.hold:
                self.all_in.set()
            await asyncio.wait_for(self.all_in.wait(), 10)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        base = {"id": "c", "object": "text_completion", "created": 0, "model": "m"}
        for text in ["", *(f" t{i}" for i in range(n))]:
            chunk = {**base, "choices": [{"text": text, "index": 0, "finish_reason": None}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        if self.usage:
            usage = {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": n + 3}
            await resp.write(
                f"data: {json.dumps({**base, 'choices': [], 'usage': usage})}\n\n".encode()
            )
        await resp.write(b"data: [DONE]\n\n")
        return resp


def serve_and_run(
    fake: FakeOpenAI, workload: dict[str, list[Prompt]], max_tokens: tuple[int, int]
) -> tuple[dict[str, Any], int]:
    ticks = []

    async def run() -> dict[str, Any]:
        app = web.Application()
        app.router.add_get("/v1/models", fake.models)
        app.router.add_post("/v1/completions", fake.completions)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        port = runner.addresses[0][1]
        try:
            url = f"http://127.0.0.1:{port}"
            return await run_workload(url, "sk-k", workload, max_tokens, lambda: ticks.append(1))
        finally:
            await runner.cleanup()

    return asyncio.run(run()), len(ticks)


def tiny_workload() -> dict[str, list[Prompt]]:
    def ps(name: str, n: int) -> list[Prompt]:
        return [Prompt(f"{name} prompt {i}", 3) for i in range(n)]

    return {
        "warm_c1": ps("w1", 2),
        "warm_c16": ps("w16", 4),
        "c1": ps("c1", 3),
        "c16": ps("c16", 4),
    }


def test_both_sides_send_the_same_greedy_streams_and_count_the_usage() -> None:
    wl = tiny_workload()
    sent = []
    for _side in (OURS, STOCK):  # each phase meets its own server, with one workload
        fake = FakeOpenAI(hold_tokens=6, hold=4)
        result, ticks = serve_and_run(fake, wl, (5, 6))
        sent.append([b["prompt"] for b in fake.bodies])
        assert ticks == 13  # every request, warm-up included
        assert fake.keys == {"Bearer sk-k"}
        for b in fake.bodies:
            assert (b["model"], b["stream"], b["temperature"]) == ("m", True, 0)
            assert b["ignore_eos"] is True
            assert b["stream_options"] == {"include_usage": True}
        # warm-up bursts are short; the measured sets ask for their own max_tokens
        assert [b["max_tokens"] for b in fake.bodies[:6]] == [5, 5, 8, 8, 8, 8]
        assert result["model"] == "m"
        assert [r["tokens"] for r in result["c1"]] == [5, 5, 5]
        assert [r["tokens"] for r in result["c16"]] == [6] * 4
        assert all(r["usage"] for r in result["c1"] + result["c16"])
        assert all(0 < r["ttft_s"] <= r["total_s"] for r in result["c1"])
        assert result["c16_wall_s"] > 0
    assert sent[0] == sent[1]
    assert sent[0][:2] == [p.text for p in wl["warm_c1"]]
    assert sent[0][6:9] == [p.text for p in wl["c1"]]
    assert sorted(sent[0][9:]) == sorted(p.text for p in wl["c16"])


def test_without_usage_the_text_chunks_are_counted() -> None:
    fake = FakeOpenAI(hold_tokens=6, hold=4, usage=False)
    result, _ = serve_and_run(fake, tiny_workload(), (5, 6))
    assert [(r["tokens"], r["usage"]) for r in result["c1"]] == [(5, False)] * 3


def phase(
    ttfts_c1: list[float], gaps: list[float], c16_tokens: list[int], wall: float
) -> dict[str, Any]:
    return {
        "c1": [{"ttft_s": t, "gap_s": g} for t, g in zip(ttfts_c1, gaps, strict=True)],
        "c16": [{"ttft_s": 0.5, "tokens": n} for n in c16_tokens],
        "c16_wall_s": wall,
    }


def test_figures_ratio_and_medians_over_rounds() -> None:
    p = phase([0.1, 0.2, 0.3, 0.4, 0.5], [0.01, 0.02, 0.03, 0.04, 0.05], [100, 100], 2.0)
    row = summarize_phase(p)
    assert row["ttft_c1_p50_ms"] == pytest.approx(300)
    assert row["ttft_c1_p90_ms"] == pytest.approx(460)  # interpolated: 400 + 0.6 * 100
    assert row["itl_c1_p50_ms"] == pytest.approx(30)
    assert row["tok_s_c16"] == pytest.approx(100)  # 200 tokens in 2 s
    assert row["ttft_c16_p50_ms"] == pytest.approx(500)
    slow = phase([0.6] * 5, [0.02] * 5, [100, 100], 4.0)
    fast = phase([0.2] * 5, [0.01] * 5, [100, 100], 1.0)
    table = summarize({OURS: [p, slow, fast], STOCK: [fast]})
    assert table[OURS]["ttft_c1_p50_ms"] == pytest.approx(300)  # median of 300, 600, 200
    assert table[OURS]["tok_s_c16"] == pytest.approx(100)  # median of 100, 50, 200
    rat = ratios(table)
    assert set(rat) == set(FIGURES)
    assert rat["ttft_c1_p50_ms"] == pytest.approx(1.5)
    assert rat["tok_s_c16"] == pytest.approx(0.5)
    assert ratios({OURS: table[OURS]}) == {}  # one side alone: no ratio


def args_of(*argv: str) -> argparse.Namespace:
    return parse_args(["--sides", OURS, "--seed", "3", *argv])


def test_report_shape_and_chart(tmp_path: Path) -> None:
    args = args_of("--rounds", "2")
    wl = tiny_workload()
    runs = {
        OURS: [phase([0.4] * 3, [0.01] * 3, [6] * 4, 1.0) for _ in range(2)],
        STOCK: [phase([0.2] * 3, [0.01] * 3, [6] * 4, 0.5) for _ in range(2)],
    }
    for p in runs[OURS] + runs[STOCK]:
        p.update(loadavg_before=(1.0, 1, 1), loadavg_after=(1.2, 1, 1))
    facts = machine_facts()
    report = build_report(args, facts, wl, runs)
    assert report["ttft_c1_target_met"] is False  # 400 ms against 200
    assert report["ratio_ours_over_smg_vllm"]["ttft_c1_p50_ms"] == pytest.approx(2.0)
    assert report["prompt_tokens"]["c16"] == [3] * 4
    assert report["settings"]["seed"] == 3
    assert set(report["sides"]) == {OURS, STOCK}
    assert len(report["runs"][STOCK]) == 2
    path = save_report(
        str(tmp_path / "sb"), report, lambda png: plot(report["figures"], facts, png)
    )
    saved = json.loads(path.read_text())
    assert {"cpu", "isa", "cores", "loadavg", "loadavg_at_save"} <= set(saved["machine"])
    assert saved["runs"][OURS][0]["loadavg_before"] == [1.0, 1, 1]
    assert (tmp_path / "sb.png").stat().st_size > 0


def test_flags_and_a_fresh_seed_every_run() -> None:
    args = args_of("--prompt-tokens", "100-200")
    assert args.prompt_tokens == (100, 200)
    assert args.sides == [OURS]
    fresh = [parse_args(["--sides", OURS]).seed for _ in range(3)]
    assert len(set(fresh)) > 1
    with pytest.raises(SystemExit):
        parse_args(["--sides", "ours,tgi"])


def test_main_alternates_the_phases_over_one_workload(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    calls: list[tuple[str, int]] = []

    def fake_phase(side: str, args: Any, workload: Any, tick: Any) -> dict[str, Any]:
        calls.append((side, id(workload)))
        for _ in range(sum(len(v) for v in workload.values())):
            tick()
        p = phase([0.3] * 3, [0.01] * 3, [8] * 2, 1.0)
        return {
            **p,
            "loadavg_before": (1, 1, 1),
            "loadavg_measure_start": (1, 1, 1),
            "loadavg_after": (1, 1, 1),
        }

    monkeypatch.setattr(stack_bench, "run_phase", fake_phase)
    monkeypatch.setattr(stack_bench, "isa_facts", lambda *a: {"env": {}})
    before = signal.getsignal(signal.SIGTERM)
    try:
        argv = ["--requests-c1", "3", "--streams", "2", "--warmup", "1", "--rounds", "2"]
        stack_bench.main(
            [
                *argv,
                "--sides",
                f"{OURS},{STOCK}",
                "--vllm-python",
                __file__,
                "--out",
                str(tmp_path / "m"),
            ]
        )
    finally:
        signal.signal(signal.SIGTERM, before)
    assert [c[0] for c in calls] == [OURS, STOCK, OURS, STOCK]
    assert len({c[1] for c in calls}) == 1  # one workload object for every phase
    saved = json.loads((tmp_path / "m.json").read_text())
    assert saved["ratio_ours_over_smg_vllm"]["ttft_c1_p50_ms"] == pytest.approx(1.0)
    assert saved["ttft_c1_target_met"] is True
