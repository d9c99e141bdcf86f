"""Decisions of the TensorRT-LLM adapter that hold without TensorRT-LLM: KV cache dtype
by GPU capability, priority order, parallel settings, reading TensorRT-LLM's iteration
stats and the checkpoint's model info. What a client sees through the adapter is the
backend contract suite's (over a fake of TensorRT-LLM's API here, the real one on a
GPU)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from engine_svc.backends.base import BackendUnavailableError
from engine_svc.backends.trtllm import (
    TrtLlmBackend,
    llm_kwargs,
    model_info_from_dir,
    priority_fraction,
    stats_from_iteration,
    trt_kv_cache_dtype,
)
from engine_svc.core.config import EngineConfig

HAS_TRTLLM = importlib.util.find_spec("tensorrt_llm") is not None


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


def test_parallel_settings_reach_tensorrt_llm_and_the_native_engine_refuses_them() -> None:
    from engine_svc.core import LLMEngine

    kw = llm_kwargs(EngineConfig(model_dir="/m", tensor_parallel_size=4, pipeline_parallel_size=2))
    assert (kw["tensor_parallel_size"], kw["pipeline_parallel_size"]) == (4, 2)
    with pytest.raises(ValueError, match="one device"):
        LLMEngine(EngineConfig(model_dir="/m", tensor_parallel_size=2))
