"""TensorRT-LLM adapter mapping, tested without TensorRT-LLM (never run on a GPU here)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_svc.backends.base import BackendUnavailableError
from engine_svc.backends.streaming import StreamState
from engine_svc.backends.trtllm import (
    TrtLlmBackend,
    llm_kwargs,
    model_info_from_dir,
    priority_fraction,
    sampling_kwargs,
    stats_from_iteration,
    trt_kv_cache_dtype,
)
from engine_svc.core.config import EngineConfig
from engine_svc.core.request import FinishReason
from engine_svc.core.sampling_params import SamplingParams

HAS_TRTLLM = importlib.util.find_spec("tensorrt_llm") is not None


def test_llm_kwargs_map_the_engine_config() -> None:
    cfg = EngineConfig(
        model_dir="/m",
        max_num_seqs=64,
        max_num_batched_tokens=2048,
        max_model_len=4096,
        enable_prefix_caching=True,
        kv_cache_memory_fraction=0.85,
        block_size=32,
    )
    kw = llm_kwargs(cfg)
    assert kw["model"] == "/m"
    assert kw["skip_tokenizer_init"] is True
    assert kw["kv_cache_config"] == {
        "dtype": "fp8",
        "enable_block_reuse": True,
        "free_gpu_memory_fraction": 0.85,
        "tokens_per_block": 32,
    }
    assert (kw["max_batch_size"], kw["max_num_tokens"], kw["max_seq_len"]) == (64, 2048, 4096)
    assert kw["enable_chunked_prefill"] is True
    assert kw["scheduler_config"]["capacity_scheduler_policy"] == "MAX_UTILIZATION"
    assert "max_seq_len" not in llm_kwargs(EngineConfig(model_dir="/m"))
    assert (
        llm_kwargs(EngineConfig(num_kv_blocks=10, block_size=16))["kv_cache_config"]["max_tokens"]
        == 160
    )


def test_sampling_kwargs() -> None:
    p = SamplingParams(
        max_tokens=9,
        temperature=0.7,
        top_p=0.9,
        top_k=40,
        seed=7,
        stop_token_ids=[5],
        min_tokens=2,
        logprobs=3,
    )
    kw = sampling_kwargs(p, [2])
    assert kw["max_tokens"] == 9
    assert (kw["temperature"], kw["top_p"], kw["top_k"], kw["seed"]) == (0.7, 0.9, 40, 7)
    assert (kw["end_id"], kw["stop_token_ids"], kw["min_tokens"], kw["logprobs"]) == (2, [5], 2, 3)
    assert kw["detokenize"] is False
    assert None not in kw.values()
    greedy = sampling_kwargs(SamplingParams(max_tokens=3, ignore_eos=True), [2])
    assert greedy["end_id"] == -1
    assert "top_k" not in greedy  # 0 = off is left to TensorRT-LLM's default


def test_stream_state_holds_back_a_possible_stop_and_trims_a_completed_one() -> None:
    p = SamplingParams(max_tokens=10, stop_sequences=[[7, 8]])
    state = StreamState("r", num_prompt_tokens=3, params=p, arrival_time=0.0)
    a = state.advance([1, 2], None, 1.0)
    assert (a.new_token_ids, a.finished, a.first_token_time) == ([1, 2], False, 1.0)
    b = state.advance([1, 2, 3, 7], None, 2.0)
    assert b.new_token_ids == [3]  # 7 may begin the stop sequence: not sent yet
    c = state.advance([1, 2, 3, 7, 8], None, 3.0)  # it completes: trimmed, STOP
    assert (c.new_token_ids, c.finished, c.finish_reason) == ([], True, FinishReason.STOP)
    assert c.num_output_tokens == 5
    d = StreamState("s", 1, SamplingParams(max_tokens=2), 0.0).advance([4, 5], "length", 1.0)
    assert (d.new_token_ids, d.finish_reason, d.finished_time) == ([4, 5], FinishReason.LENGTH, 1.0)


def _expected(out: list[int], stops: list[list[int]], min_tokens: int) -> tuple[list[int], bool]:
    """What a client should get, by the native engine's rule: the output up to the
    first completed stop sequence (not counted before min_tokens), without it."""
    for n in range(1, len(out) + 1):
        if n < min_tokens:
            continue
        for seq in stops:
            if seq and n >= len(seq) and out[n - len(seq) : n] == seq:
                return out[: n - len(seq)], True
    return out, False


@settings(max_examples=300, deadline=None)
@given(
    out=st.lists(st.integers(0, 3), max_size=14),
    stops=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=3), max_size=2),
    min_tokens=st.integers(0, 4),
    step=st.integers(1, 3),
)
def test_streamed_deltas_never_contain_a_token_of_a_trimmed_stop(
    out: list[int], stops: list[list[int]], min_tokens: int, step: int
) -> None:
    params = SamplingParams(
        max_tokens=max(1, len(out)),
        stop_sequences=stops,
        min_tokens=min(min_tokens, max(1, len(out))),
    )
    state = StreamState("r", 1, params, 0.0)
    sent: list[int] = []
    finished = False
    for n in range(step, len(out) + step, step):  # TensorRT-LLM may add several at once
        last = n >= len(out)
        o = state.advance(out[:n], "length" if last else None, float(n))
        sent += o.new_token_ids
        if o.finished:
            finished = True
            break
    want, stopped = _expected(out, stops, params.min_tokens)
    assert finished == bool(stopped or out)
    assert sent == want  # also when a chunk brings the stop and tokens past it


def test_resumed_tokens_are_not_resent_and_count_against_max_tokens() -> None:
    p = SamplingParams(max_tokens=6, min_tokens=3, stop_sequences=[[6, 9]])
    kw = sampling_kwargs(p, [2], num_resumed=2)
    assert (kw["max_tokens"], kw["min_tokens"]) == (4, 1)
    state = StreamState("r", 4, p, 0.0, resumed=[5, 6])
    first = state.advance([9], None, 1.0)  # the stop spans the resumed and the new token
    assert (first.new_token_ids, first.finish_reason) == ([], FinishReason.STOP)
    assert (first.num_output_tokens, first.num_resumed_tokens) == (3, 2)
    cont = StreamState("r2", 4, SamplingParams(max_tokens=6), 0.0, resumed=[5, 6])
    assert cont.advance([7, 8], None, 1.0).new_token_ids == [7, 8]


def test_kv_cache_dtype_follows_the_config_and_the_gpu() -> None:
    assert trt_kv_cache_dtype("auto", fp8_capable=True) == "fp8"
    assert trt_kv_cache_dtype("auto", fp8_capable=False) == "auto"
    assert trt_kv_cache_dtype("bfloat16", fp8_capable=True) == "auto"
    assert trt_kv_cache_dtype("fp8", fp8_capable=True) == "fp8"
    with pytest.raises(ValueError, match="compute capability"):
        trt_kv_cache_dtype("fp8", fp8_capable=False)
    with pytest.raises(ValueError, match="float32"):
        trt_kv_cache_dtype("float32", fp8_capable=True)
    assert llm_kwargs(EngineConfig(model_dir="/m"), "auto")["kv_cache_config"]["dtype"] == "auto"


def test_priority_maps_onto_tensorrt_llm_s_scale() -> None:
    assert priority_fraction(3) > priority_fraction(2) > priority_fraction(1)
    assert priority_fraction(0) == priority_fraction(2) == 0.5


def test_stats_from_iteration() -> None:
    it = {
        "iter": 12,
        "numActiveRequests": 5,
        "numQueuedRequests": 2,
        "kvCacheStats": {
            "usedNumBlocks": 30,
            "maxNumBlocks": 120,
            "reusedBlocks": 6,
            "missedBlocks": 18,
        },
        "inflightBatchingStats": {"numPausedRequests": 1},
    }
    s = stats_from_iteration(it, 64, 256, {"requests": 9, "prompt": 100, "generation": 50})
    assert (s.num_running, s.num_waiting, s.num_kv_blocks_used) == (5, 2, 30)
    assert s.kv_cache_usage == pytest.approx(0.25)
    assert s.prefix_cache_hit_rate == pytest.approx(0.25)
    assert (s.num_requests_total, s.max_num_seqs, s.num_steps_total) == (9, 64, 12)
    assert stats_from_iteration({}, 1, 1, {}).kv_cache_usage == 0.0


def test_model_info_from_checkpoint(model_dir: Path) -> None:
    info = model_info_from_dir(model_dir, EngineConfig(max_model_len=4096))
    assert (info.vocab_size, info.eos_token_ids, info.max_context_length) == (49152, [2], 4096)
    assert (info.backend, info.kv_cache_dtype) == ("trtllm", "fp8_e4m3")
    assert info.weight_dtype == "float32"  # not a ModelOpt FP8 checkpoint


@pytest.mark.skipif(HAS_TRTLLM, reason="tensorrt_llm is installed here")
async def test_missing_tensorrt_llm_is_a_clear_error() -> None:
    with pytest.raises(BackendUnavailableError, match="needs the tensorrt_llm package"):
        await TrtLlmBackend(EngineConfig()).start()


@pytest.mark.trtllm
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_TRTLLM, reason="needs TensorRT-LLM and an NVIDIA GPU")
async def test_trtllm_generates(model_dir: Path) -> None:  # pragma: no cover - GPU only
    from engine_svc.backends.base import GenerateInput

    backend = TrtLlmBackend(EngineConfig(model_dir=str(model_dir)))
    await backend.start()
    try:
        outs = [
            o
            async for o in backend.generate(
                GenerateInput("g", [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))
            )
        ]
        assert sum(len(o.new_token_ids) for o in outs) == 4
        assert outs[-1].finished
    finally:
        await backend.stop()


def test_parallel_settings_reach_tensorrt_llm_and_the_native_engine_refuses_them() -> None:
    from engine_svc.core import LLMEngine

    kw = llm_kwargs(EngineConfig(model_dir="/m", tensor_parallel_size=4, pipeline_parallel_size=2))
    assert (kw["tensor_parallel_size"], kw["pipeline_parallel_size"]) == (4, 2)
    with pytest.raises(ValueError, match="one device"):
        LLMEngine(EngineConfig(model_dir="/m", tensor_parallel_size=2))
