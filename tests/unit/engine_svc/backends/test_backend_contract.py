"""What a client of any Backend sees, asserted through the Backend protocol alone.

Parametrized over the backends (the id names each; native is the only one now): the
native engine on a tiny random Llama on the CPU (the contract is about streaming,
stops, limits, resumption, sampling and clean-up, not model quality), its expected
outputs from an offline LLMEngine run of the same request. (vLLM and TensorRT-LLM
are reached as their stock gRPC servers, ``vllm serve --grpc`` and ``trtllm-serve
--grpc``, not through a backend.)
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from engine_svc.backends.base import Backend, GenerateInput, QueueFullError
from engine_svc.backends.native import NativeBackend
from engine_svc.core import EngineConfig, LLMEngine, SamplingParams, SchedulerConfig
from engine_svc.core.outputs import RequestOutput
from engine_svc.core.request import FinishReason
from tests.unit.engine_svc.helpers import run_to_completion, tokens_of

T = TypeVar("T")
PROMPT = [5, 17, 42, 8, 23, 61, 7]
# every backend: two running and one waiting at most, so a flood is easy to make
MAX_NUM_SEQS, MAX_WAITING = 2, 1


def engine_config(model_dir: Path) -> EngineConfig:
    # deploy/gpu-check.sh sets LLM_TEST_ENGINE_DEVICE=cuda to run the native side on a GPU
    device = os.environ.get("LLM_TEST_ENGINE_DEVICE", "cpu")
    return EngineConfig(
        model_dir=str(model_dir),
        dtype="float32",
        device=device,
        block_size=4,
        num_kv_blocks=128,
        scheduler=SchedulerConfig(
            max_num_batched_tokens=64, max_num_seqs=MAX_NUM_SEQS, max_waiting=MAX_WAITING
        ),
        enable_prefix_caching=False,
    )


class Harness:
    """A started backend on an event loop of its own thread; ``run`` waits for a coroutine."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.run(backend.start(), timeout=600)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 120) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stream(self, inp: GenerateInput) -> list[RequestOutput]:
        async def collect() -> list[RequestOutput]:
            return [o async for o in self.backend.generate(inp)]

        return self.run(collect())

    def idle(self, timeout: float = 10) -> bool:
        """Whether the engine holds nothing (no request, no KV block) within ``timeout``."""

        async def poll() -> bool:
            for _ in range(int(timeout / 0.01)):
                e = self.backend.stats().engine
                if e.num_running == 0 and e.num_waiting == 0 and e.num_kv_blocks_used == 0:
                    return True
                await asyncio.sleep(0.01)
            return False

        return self.run(poll())

    def close(self) -> None:
        self.run(self.backend.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
        self.loop.close()


def _native(model_dir: Path) -> Backend:
    return NativeBackend(lambda: LLMEngine(engine_config(model_dir)))


BACKENDS: dict[str, Callable[[Path], Backend]] = {"native": _native}


@pytest.fixture(scope="module", params=sorted(BACKENDS))
def harness(request: pytest.FixtureRequest, tiny_model_dir: Path) -> Iterator[Harness]:
    h = Harness(BACKENDS[request.param](tiny_model_dir))
    try:
        yield h
    finally:
        h.close()


@pytest.fixture(scope="module")
def offline(tiny_model_dir: Path) -> Callable[[SamplingParams], list[int]]:
    """The reference output of a request: the offline CPU engine (same numerics as the
    native backend)."""
    engine = LLMEngine(engine_config(tiny_model_dir))
    n = 0

    def generate(params: SamplingParams) -> list[int]:
        nonlocal n
        n += 1
        engine.add_request(f"off-{n}", PROMPT, params)
        return tokens_of(run_to_completion(engine)[f"off-{n}"])

    return generate


_ids = iter(range(10**9))


def inp(params: SamplingParams, **kw: Any) -> GenerateInput:
    return GenerateInput(
        request_id=f"c-{next(_ids)}", prompt_token_ids=list(PROMPT), sampling_params=params, **kw
    )


def streamed(outs: list[RequestOutput]) -> list[int]:
    assert outs[-1].finished
    assert not any(o.finished for o in outs[:-1]), "nothing may follow the final output"
    return [t for o in outs for t in o.new_token_ids]


def test_streamed_deltas_make_up_the_offline_greedy_output(harness: Harness, offline: Any) -> None:
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    outs = harness.stream(inp(params))
    assert streamed(outs) == offline(params)
    assert outs[-1].finish_reason == FinishReason.LENGTH
    assert outs[-1].num_output_tokens == 12


def test_a_multi_token_stop_sequence_is_held_back_and_trimmed(
    harness: Harness, offline: Any
) -> None:
    greedy = offline(SamplingParams(max_tokens=12, ignore_eos=True))
    stop = greedy[5:7]
    first = next(i for i in range(len(greedy)) if greedy[i : i + 2] == stop)
    outs = harness.stream(
        inp(SamplingParams(max_tokens=12, ignore_eos=True, stop_sequences=[stop]))
    )
    assert streamed(outs) == greedy[:first]
    assert outs[-1].finish_reason == FinishReason.STOP
    kept = harness.stream(
        inp(
            SamplingParams(
                max_tokens=12, ignore_eos=True, stop_sequences=[stop], include_stop_in_output=True
            )
        )
    )
    assert streamed(kept) == greedy[: first + 2]


def test_a_resumed_stream_continues_within_the_original_max_tokens(
    harness: Harness, offline: Any
) -> None:
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    greedy = offline(params)
    outs = harness.stream(inp(params, resumed_output_token_ids=greedy[:4]))
    assert streamed(outs) == greedy[4:]  # the resumed tokens are not sent again
    assert outs[-1].num_output_tokens == 12
    assert outs[-1].finish_reason == FinishReason.LENGTH


def test_stop_token_ids_wait_for_min_tokens(harness: Harness, offline: Any) -> None:
    greedy = offline(SamplingParams(max_tokens=12, ignore_eos=True))
    stop_id, min_tokens = greedy[1], 4
    params = SamplingParams(
        max_tokens=12, ignore_eos=True, stop_token_ids=[stop_id], min_tokens=min_tokens
    )
    outs = harness.stream(inp(params))
    tokens = streamed(outs)
    assert tokens == offline(params)
    assert stop_id not in tokens[:min_tokens]  # suppressed until min_tokens are out
    assert len(tokens) >= min_tokens
    if outs[-1].finish_reason == FinishReason.STOP:
        assert outs[-1].stop_token_id == stop_id


def test_a_seed_fixes_sampled_output(harness: Harness) -> None:
    def sample(seed: int) -> list[int]:
        return streamed(
            harness.stream(
                inp(SamplingParams(max_tokens=16, temperature=1.0, seed=seed, ignore_eos=True))
            )
        )

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


def test_logprobs_come_with_every_token(harness: Harness) -> None:
    outs = harness.stream(inp(SamplingParams(max_tokens=6, ignore_eos=True, logprobs=3)))
    tokens = streamed(outs)
    lps = [lp for o in outs for lp in (o.new_logprobs or [])]
    assert [lp.token_id for lp in lps] == tokens
    for lp in lps:
        assert len(lp.top_logprobs) == len(lp.top_token_ids) == 3
        assert lp.top_logprobs == sorted(lp.top_logprobs, reverse=True)
        assert lp.logprob <= 0.0
        assert lp.rank >= 1
        assert lp.logprob <= lp.top_logprobs[0] + 1e-6


def test_closing_a_stream_early_frees_everything(harness: Harness) -> None:
    async def first_then_close() -> RequestOutput:
        stream = harness.backend.generate(inp(SamplingParams(max_tokens=200, ignore_eos=True)))
        first = await anext(stream)
        await stream.aclose()  # type: ignore[attr-defined]
        return first

    assert not harness.run(first_then_close()).finished
    assert harness.idle()


def test_past_its_queue_a_request_is_refused_with_a_retry_after(harness: Harness) -> None:
    """A flood cannot queue unbounded work: with max_num_seqs running and max_waiting
    waiting, the next request is refused (QueueFullError, a retry-after); closing the
    flood frees everything."""
    cap = MAX_NUM_SEQS + MAX_WAITING
    long = SamplingParams(max_tokens=240, ignore_eos=True)  # outlives the check below

    async def flood() -> tuple[int, int]:
        streams = [harness.backend.generate(inp(long)) for _ in range(cap)]
        firsts = [asyncio.ensure_future(anext(s)) for s in streams]  # type: ignore[arg-type]
        try:
            for _ in range(1000):  # until the engine holds all of them
                e = harness.backend.stats().engine
                if e.num_running + e.num_waiting >= cap:
                    break
                await asyncio.sleep(0.01)
            extra = harness.backend.generate(inp(SamplingParams(max_tokens=2)))
            with pytest.raises(QueueFullError, match="waiting queue is full") as err:
                await anext(extra)  # type: ignore[call-overload]
            e = harness.backend.stats().engine
            return err.value.retry_after_ms, e.num_running + e.num_waiting
        finally:
            for f in firsts:
                f.cancel()
            await asyncio.gather(*firsts, return_exceptions=True)
            for s in streams:
                await s.aclose()  # type: ignore[attr-defined]

    retry_after_ms, held = harness.run(flood())
    assert retry_after_ms > 0
    assert held <= cap
    assert harness.idle()


def test_an_impossible_request_is_a_value_error_that_says_why(harness: Harness) -> None:
    vocab = harness.backend.model_info().vocab_size
    bad = GenerateInput(
        request_id="bad-1",
        prompt_token_ids=[1, vocab + 3],
        sampling_params=SamplingParams(max_tokens=4),
    )
    with pytest.raises(ValueError, match="outside the vocabulary"):
        harness.stream(bad)


def test_model_info_and_stats_describe_the_engine(harness: Harness) -> None:
    info = harness.backend.model_info()
    assert info.vocab_size > 0
    assert info.max_context_length > len(PROMPT)
    before = harness.backend.stats().engine.num_requests_total
    harness.stream(inp(SamplingParams(max_tokens=2, ignore_eos=True)))
    stats = harness.backend.stats()
    assert stats.engine.max_num_seqs > 0
    assert stats.engine.num_requests_total == before + 1
