"""TensorRT-LLM adapter mapping, tested without TensorRT-LLM (never run on a GPU here)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from engine_svc.backends.base import BackendUnavailableError
from engine_svc.backends.trtllm import (
    StreamState,
    TrtLlmBackend,
    llm_kwargs,
    match_stop_sequence,
    model_info_from_dir,
    sampling_kwargs,
    stats_from_iteration,
)
from engine_svc.core.config import EngineConfig
from engine_svc.core.request import FinishReason
from engine_svc.core.sampling_params import SamplingParams

HAS_TRTLLM = importlib.util.find_spec("tensorrt_llm") is not None


def test_llm_kwargs_map_the_engine_config() -> None:
    cfg = EngineConfig(model_dir="/m", max_num_seqs=64, max_num_batched_tokens=2048,
                       max_model_len=4096, enable_prefix_caching=True,
                       kv_cache_memory_fraction=0.85, block_size=32)
    kw = llm_kwargs(cfg)
    assert kw["model"] == "/m"
    assert kw["skip_tokenizer_init"] is True
    assert kw["kv_cache_config"] == {"dtype": "fp8", "enable_block_reuse": True,
                                     "free_gpu_memory_fraction": 0.85, "tokens_per_block": 32}
    assert (kw["max_batch_size"], kw["max_num_tokens"], kw["max_seq_len"]) == (64, 2048, 4096)
    assert kw["enable_chunked_prefill"] is True
    assert kw["scheduler_config"]["capacity_scheduler_policy"] == "MAX_UTILIZATION"
    assert "max_seq_len" not in llm_kwargs(EngineConfig(model_dir="/m"))
    assert llm_kwargs(EngineConfig(num_kv_blocks=10, block_size=16))["kv_cache_config"][
        "max_tokens"] == 160


def test_sampling_kwargs() -> None:
    p = SamplingParams(max_tokens=9, temperature=0.7, top_p=0.9, top_k=40, seed=7,
                       stop_token_ids=[5], min_tokens=2, logprobs=3)
    kw = sampling_kwargs(p, [2])
    assert kw["max_tokens"] == 9
    assert (kw["temperature"], kw["top_p"], kw["top_k"], kw["seed"]) == (0.7, 0.9, 40, 7)
    assert (kw["end_id"], kw["stop_token_ids"], kw["min_tokens"], kw["logprobs"]) == (2, [5], 2, 3)
    assert kw["detokenize"] is False
    assert None not in kw.values()
    greedy = sampling_kwargs(SamplingParams(max_tokens=3, ignore_eos=True), [2])
    assert greedy["end_id"] == -1
    assert "top_k" not in greedy  # 0 = off is left to TensorRT-LLM's default


def test_stream_state_turns_cumulative_ids_into_deltas_with_stop_sequences() -> None:
    p = SamplingParams(max_tokens=10, stop_sequences=[[7, 8]])
    st = StreamState("r", num_prompt_tokens=3, params=p, arrival_time=0.0)
    a = st.advance([1, 2], None, 1.0)
    assert (a.new_token_ids, a.finished, a.first_token_time) == ([1, 2], False, 1.0)
    b = st.advance([1, 2, 3, 7], None, 2.0)
    assert b.new_token_ids == [3, 7]
    c = st.advance([1, 2, 3, 7, 8], None, 3.0)  # stop sequence completes: trimmed, STOP
    assert (c.new_token_ids, c.finished, c.finish_reason) == ([], True, FinishReason.STOP)
    assert c.num_output_tokens == 5
    d = StreamState("s", 1, SamplingParams(max_tokens=2), 0.0).advance([4, 5], "length", 1.0)
    assert (d.new_token_ids, d.finish_reason, d.finished_time) == ([4, 5], FinishReason.LENGTH,
                                                                   1.0)


def test_match_stop_sequence() -> None:
    assert match_stop_sequence([1, 2, 3], [[2, 3], [3]]) == 2
    assert match_stop_sequence([1, 2, 3], [[9]]) == 0
    assert match_stop_sequence([3], [[2, 3]]) == 0


def test_stats_from_iteration() -> None:
    it = {"iter": 12, "numActiveRequests": 5, "numQueuedRequests": 2,
          "kvCacheStats": {"usedNumBlocks": 30, "maxNumBlocks": 120, "reusedBlocks": 6,
                           "missedBlocks": 18},
          "inflightBatchingStats": {"numPausedRequests": 1}}
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
        outs = [o async for o in backend.generate(
            GenerateInput("g", [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True)))]
        assert sum(len(o.new_token_ids) for o in outs) == 4
        assert outs[-1].finished
    finally:
        await backend.stop()
