"""The standard protocols' translation functions, proto <-> domain (no server, no model
except the real tokenizer files for stop strings and the bundle)."""

from __future__ import annotations

import hashlib
import io
import zipfile
from pathlib import Path

import pytest
from smg_grpc_proto.generated import trtllm_service_pb2, vllm_engine_pb2

from engine_svc.core.outputs import EngineStats, ModelInfo, RequestOutput
from engine_svc.core.request import FinishReason, TokenLogprobs
from engine_svc.standard import trtllm_service as trt
from engine_svc.standard import vllm_engine as vllm
from engine_svc.standard.shared import (
    StopStrings,
    UnsupportedFieldError,
    bundle_chunks,
    finish_name,
    tokenizer_bundle,
)
from engine_svc.stats import BackendStats
from tokenizer_svc.tokenizer import TextTokenizer

INFO = ModelInfo(model="m", max_context_length=100, vocab_size=1000, eos_token_ids=[2])


def vreq(**sampling: object) -> vllm_engine_pb2.GenerateRequest:
    return vllm_engine_pb2.GenerateRequest(
        request_id="r",
        tokenized=vllm_engine_pb2.TokenizedInput(input_ids=[5, 6, 7]),
        sampling_params=vllm_engine_pb2.SamplingParams(**sampling),  # type: ignore[arg-type]
    )


def test_vllm_defaults_are_vllms() -> None:
    inp, stops = vllm.generate_input_from_vllm(vreq(), INFO)
    p = inp.sampling_params
    assert (inp.request_id, inp.prompt_token_ids, stops) == ("r", [5, 6, 7], [])
    # unset temperature samples at 1.0; unset max_tokens takes what the context leaves
    assert (p.temperature, p.max_tokens, p.top_p, p.repetition_penalty) == (1.0, 97, 1.0, 1.0)
    assert (p.logprobs, p.seed) == (0, None)


def test_vllm_fields_map_to_the_engine() -> None:
    inp, stops = vllm.generate_input_from_vllm(
        vreq(
            temperature=0.0,
            max_tokens=9,
            top_k=4,
            top_p=0.5,
            min_tokens=2,
            seed=11,
            stop=["\n\n"],
            stop_token_ids=[3],
            ignore_eos=True,
            include_stop_str_in_output=True,
            logprobs=0,
            n=1,
            skip_special_tokens=True,
        ),
        INFO,
    )
    p = inp.sampling_params
    assert (p.temperature, p.max_tokens, p.top_k, p.top_p, p.min_tokens) == (0.0, 9, 4, 0.5, 2)
    assert (p.seed, p.stop_token_ids, p.ignore_eos, p.include_stop_in_output) == (
        11,
        [3],
        True,
        True,
    )
    assert p.logprobs == 1  # vLLM's 0: the chosen token's logprob, from one alternative
    assert stops == ["\n\n"]


@pytest.mark.parametrize(
    ("field", "req"),
    [
        ("text", vllm_engine_pb2.GenerateRequest(request_id="r", text="hi")),
        ("sampling_params.n", vreq(n=3)),
        ("sampling_params.truncate_prompt_tokens", vreq(truncate_prompt_tokens=5)),
        (
            "mm_inputs",
            vllm_engine_pb2.GenerateRequest(
                request_id="r",
                tokenized=vllm_engine_pb2.TokenizedInput(input_ids=[1]),
                mm_inputs=vllm_engine_pb2.MultimodalInputs(mm_hashes=["h"]),
            ),
        ),
    ],
)
def test_vllm_refusals_name_the_field(field: str, req: vllm_engine_pb2.GenerateRequest) -> None:
    with pytest.raises(UnsupportedFieldError, match=field.replace(".", r"\.")):
        vllm.generate_input_from_vllm(req, INFO)


def test_vllm_rank_zero_is_this_engine() -> None:
    req = vreq()
    req.data_parallel_rank = 0
    vllm.generate_input_from_vllm(req, INFO)
    req.data_parallel_rank = 2
    with pytest.raises(UnsupportedFieldError, match="data_parallel_rank"):
        vllm.generate_input_from_vllm(req, INFO)


def test_vllm_missing_input_is_invalid() -> None:
    with pytest.raises(ValueError, match="input_ids is empty"):
        vllm.generate_input_from_vllm(vllm_engine_pb2.GenerateRequest(request_id="r"), INFO)
    with pytest.raises(ValueError, match="request_id"):
        vllm.generate_input_from_vllm(
            vllm_engine_pb2.GenerateRequest(
                tokenized=vllm_engine_pb2.TokenizedInput(input_ids=[1])
            ),
            INFO,
        )


def output(**kw: object) -> RequestOutput:
    base: dict[str, object] = {
        "request_id": "r",
        "new_token_ids": [10, 11],
        "num_prompt_tokens": 3,
        "num_cached_tokens": 1,
        "num_output_tokens": 2,
    }
    return RequestOutput(**{**base, **kw})  # type: ignore[arg-type]


LPS = [
    TokenLogprobs(10, -0.1, 1, [10, 12], [-0.1, -2.0]),
    TokenLogprobs(11, -0.2, 1, [11, 13], [-0.2, -3.0]),
]


def test_vllm_chunk_and_complete() -> None:
    chunk = vllm.chunk_from_output(output(new_logprobs=LPS), top=1).chunk
    assert (list(chunk.token_ids), chunk.completion_tokens, chunk.cached_tokens) == ([10, 11], 2, 1)
    assert list(chunk.output_logprobs.token_ids) == [10, 11]
    assert [list(t.token_ids) for t in chunk.output_logprobs.top_logprobs] == [[10], [11]]
    out = output(finished=True, finish_reason=FinishReason.STOP, stop_token_id=2)
    done = vllm.complete_from_output(out, [9, 10, 11], LPS, None, None).complete
    assert (list(done.output_ids), done.completion_tokens, done.finish_reason) == (
        [9, 10, 11],
        3,
        "stop",
    )
    assert done.matched_token_id == 2
    assert not done.HasField("output_logprobs")
    by_string = vllm.complete_from_output(out, [9], [], None, "END").complete
    assert by_string.WhichOneof("matched_stop") == "matched_stop_str"


def test_finish_names() -> None:
    names = [finish_name(r) for r in (FinishReason.STOP, FinishReason.LENGTH, FinishReason.ABORT)]
    assert names == ["stop", "length", "abort"]
    assert finish_name(FinishReason.ERROR) == finish_name(None) == "error"


def test_loads_from_stats() -> None:
    e = EngineStats(
        num_waiting=2,
        num_running=3,
        num_kv_blocks_used=10,
        num_kv_blocks_total=40,
        kv_cache_usage=0.25,
        num_preemptions_total=0,
        num_requests_total=5,
        num_prompt_tokens_total=0,
        num_generation_tokens_total=0,
        num_steps_total=0,
        prefix_cache_queries=4,
        prefix_cache_hits=1,
        max_num_seqs=6,
        max_waiting=8,
    )
    load = vllm.loads_from_stats(BackendStats(e, 1.0, 7.5), block_size=16)
    assert (load.num_running_reqs, load.num_waiting_reqs, load.num_total_reqs) == (3, 2, 5)
    assert (load.num_used_tokens, load.max_total_num_tokens) == (160, 640)
    assert (load.token_usage, load.gen_throughput, load.cache_hit_rate) == (0.25, 7.5, 0.25)
    assert (load.max_running_requests, load.utilization) == (6, 0.5)


def treq(**fields: object) -> trtllm_service_pb2.GenerateRequest:
    return trtllm_service_pb2.GenerateRequest(
        request_id="t",
        tokenized=trtllm_service_pb2.TokenizedInput(input_token_ids=[5, 6]),
        max_tokens=7,
        **fields,  # type: ignore[arg-type]
    )


def test_trtllm_fields_map_to_the_engine() -> None:
    inp, stops = trt.generate_input_from_trtllm(
        treq(
            sampling_config=trtllm_service_pb2.SamplingConfig(
                temperature=0.5, top_k=3, seed=2**40, min_tokens=1, beam_width=1
            ),
            output_config=trtllm_service_pb2.OutputConfig(
                logprobs=2, exclude_input_from_output=True
            ),
            stop=["x"],
            stop_token_ids=[4],
            include_stop_token_in_output=True,
        )
    )
    p = inp.sampling_params
    assert (p.max_tokens, p.temperature, p.top_k, p.seed, p.min_tokens) == (7, 0.5, 3, 2**40, 1)
    assert (p.logprobs, p.stop_token_ids, p.include_stop_in_output, stops) == (2, [4], True, ["x"])
    default, _ = trt.generate_input_from_trtllm(treq())
    assert (default.sampling_params.temperature, default.sampling_params.logprobs) == (1.0, 0)


@pytest.mark.parametrize(
    ("field", "extra"),
    [
        (
            "sampling_config.num_return_sequences",
            {"sampling_config": trtllm_service_pb2.SamplingConfig(num_return_sequences=2)},
        ),
        (
            "sampling_config.length_penalty",
            {"sampling_config": trtllm_service_pb2.SamplingConfig(length_penalty=1.0)},
        ),
        (
            "output_config.return_generation_logits",
            {"output_config": trtllm_service_pb2.OutputConfig(return_generation_logits=True)},
        ),
        ("bad", {"bad": ["no"]}),
        ("embedding_bias", {"embedding_bias": [0.0]}),
        (
            "disaggregated_params",
            {
                "disaggregated_params": trtllm_service_pb2.DisaggregatedParams(
                    request_type=trtllm_service_pb2.DisaggregatedParams.REQUEST_TYPE_CONTEXT_ONLY
                )
            },
        ),
    ],
)
def test_trtllm_refusals_name_the_field(field: str, extra: dict[str, object]) -> None:
    with pytest.raises(UnsupportedFieldError, match=field.replace(".", r"\.")):
        trt.generate_input_from_trtllm(treq(**extra))


def test_trtllm_requires_max_tokens() -> None:
    req = treq()
    req.max_tokens = 0
    with pytest.raises(ValueError, match="max_tokens"):
        trt.generate_input_from_trtllm(req)


def test_trtllm_chunk_and_complete() -> None:
    chunk = trt.chunk_from_output(output(new_logprobs=LPS), top=2, completion_tokens=5)
    assert (chunk.request_id, chunk.chunk.completion_tokens) == ("r", 5)
    assert [len(lp.top_logprobs) for lp in chunk.chunk.logprobs] == [2, 2]
    out = output(finished=True, finish_reason=FinishReason.LENGTH, arrival_time=1.0)
    done = trt.complete_from_output(out, [1, 2], LPS, 0, None, perf=True).complete
    assert (list(done.output_token_ids), done.finish_reason) == ([1, 2], "length")
    assert [lp.token_id for lp in done.logprobs] == [10, 11]
    assert not done.logprobs[0].top_logprobs
    assert done.perf_metrics.arrival_time > 0


@pytest.fixture(scope="module")
def tok(model_dir: Path) -> TextTokenizer:
    return TextTokenizer(model_dir)


def test_stop_strings_cut_at_the_token_that_completes_the_match(tok: TextTokenizer) -> None:
    ids = tok.encode("Hello there, world. Goodbye now.", add_special_tokens=False)
    stops = StopStrings(tok, ["world."])
    keep, matched = stops.add(ids[:2])
    assert (keep, matched) == (2, None)
    keep, matched = stops.add(ids[2:])
    assert matched == "world."
    got = ids[: 2 + keep]
    assert tok.decode(got).endswith("world.")
    assert "world." not in tok.decode(got[:-1])


def test_stop_strings_across_steps_and_min_tokens(tok: TextTokenizer) -> None:
    ids = tok.encode("ab ab ab", add_special_tokens=False)
    one_by_one = StopStrings(tok, ["ab ab"])
    results = [one_by_one.add([i]) for i in ids]
    first = next(n for n, (_, m) in enumerate(results) if m is not None)
    assert "ab ab" in tok.decode(ids[: first + 1])
    assert "ab ab" not in tok.decode(ids[:first])
    late = StopStrings(tok, ["ab"], min_tokens=len(ids))
    assert late.add(ids) == (len(ids), None)


def test_tokenizer_bundle_is_reproducible_with_its_sha256(model_dir: Path) -> None:
    bundle = tokenizer_bundle(model_dir)
    assert bundle == tokenizer_bundle(model_dir)  # fixed timestamps: the same sha256
    with zipfile.ZipFile(io.BytesIO(bundle)) as zf:
        assert {"tokenizer.json", "tokenizer_config.json", "config.json"} <= set(zf.namelist())
    pieces = bundle_chunks(bundle, size=1 << 20)
    assert b"".join(d for d, _ in pieces) == bundle
    assert [s for _, s in pieces] == [""] * (len(pieces) - 1) + [hashlib.sha256(bundle).hexdigest()]
    assert tokenizer_bundle(model_dir / "nope") == b""


def test_trtllm_cache_salt_id_salts_the_prefix_cache() -> None:
    salted, _ = trt.generate_input_from_trtllm(treq(cache_salt_id=7))
    other, _ = trt.generate_input_from_trtllm(treq(cache_salt_id=-7))
    zero, _ = trt.generate_input_from_trtllm(treq(cache_salt_id=0))
    unsalted, _ = trt.generate_input_from_trtllm(treq())
    assert len({salted.cache_salt, other.cache_salt, zero.cache_salt}) == 3
    assert unsalted.cache_salt == ""
