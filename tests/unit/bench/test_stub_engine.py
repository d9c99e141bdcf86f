"""The bench's no-model engine backend: the tokens asked for, at once, and nothing held
after a stream ends or is dropped."""

from __future__ import annotations

import asyncio

import pytest

from bench.gatewaylib.stub_engine import StubBackend
from engine_svc.backends.base import Backend, BackendUnavailableError, GenerateInput
from engine_svc.core.config import EngineConfig
from engine_svc.core.request import FinishReason
from engine_svc.core.sampling_params import SamplingParams


def request(rid: str, n: int) -> GenerateInput:
    return GenerateInput(rid, [5, 6, 7], SamplingParams(max_tokens=n))


async def test_it_streams_the_tokens_asked_for_and_ends_with_length() -> None:
    backend = StubBackend(EngineConfig())
    assert isinstance(backend, Backend)
    await backend.start()
    outs = [o async for o in backend.generate(request("a", 5))]
    assert [o.new_token_ids for o in outs] == [[5], [6], [7], [5], [6]]  # the prompt's ids
    assert [o.finished for o in outs] == [False] * 4 + [True]
    assert outs[-1].finish_reason == FinishReason.LENGTH
    assert outs[-1].num_output_tokens == 5
    stats = backend.stats().engine
    assert (stats.num_running, stats.num_requests_total, stats.num_generation_tokens_total) == (
        0,
        1,
        5,
    )


async def test_a_dropped_stream_leaves_nothing_running() -> None:
    backend = StubBackend(EngineConfig())
    await backend.start()
    stream = backend.generate(request("b", 100))
    first = await anext(stream)
    assert first.new_token_ids == [5]
    assert backend.stats().engine.num_running == 1
    await stream.aclose()  # the client went away
    assert backend.stats().engine.num_running == 0


async def test_a_stopped_stub_refuses_like_a_stopped_engine() -> None:
    backend = StubBackend(EngineConfig())
    with pytest.raises(BackendUnavailableError):
        await anext(backend.generate(request("c", 1)))


def test_the_first_token_wait_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from bench.gatewaylib.stub_engine import make_stub
    from engine_svc.config import EngineServiceConfig

    monkeypatch.setenv("STUB_FIRST_TOKEN_MS", "20")
    assert make_stub(EngineServiceConfig(), EngineConfig()).first_token_s == pytest.approx(0.02)
    monkeypatch.setenv("STUB_TOKEN_GAP_MS", "25")
    assert make_stub(EngineServiceConfig(), EngineConfig()).token_gap_s == pytest.approx(0.025)
    monkeypatch.delenv("STUB_FIRST_TOKEN_MS")
    monkeypatch.delenv("STUB_TOKEN_GAP_MS")
    stub = make_stub(EngineServiceConfig(), EngineConfig())
    assert (stub.first_token_s, stub.token_gap_s) == (0.0, 0.0)


async def test_later_tokens_wait_the_gap_between_them(monkeypatch: pytest.MonkeyPatch) -> None:
    waits: list[float] = []
    real_sleep = asyncio.sleep

    async def sleep(delay: float) -> None:
        waits.append(delay)
        await real_sleep(0)

    monkeypatch.setattr(asyncio, "sleep", sleep)  # the module the stub sleeps through
    backend = StubBackend(EngineConfig(), first_token_s=0.05, token_gap_s=0.02)
    await backend.start()
    outs = [o async for o in backend.generate(request("g", 3))]
    assert len(outs) == 3
    assert waits == [0.05, 0.02, 0.02, 0]  # the prefill, two gaps, none after the last
