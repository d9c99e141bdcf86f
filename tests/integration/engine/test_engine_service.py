"""The real engine service over loopback gRPC, real model, native backend (the only one:
vLLM and TensorRT-LLM run as their stock gRPC servers, tested behind the gateway in
tests/integration/stock)."""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from common.procs import ManagedProcess
from engine_svc.core.config import EngineConfig
from engine_svc.core.llm_engine import LLMEngine
from engine_svc.core.sampling_params import SamplingParams
from llm.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from tests.conftest import start_engine
from tests.integration.engine.conftest import wait_for_idle
from tokenizer_svc.chat_template import Message
from tokenizer_svc.tokenizer import TextTokenizer

pytestmark = pytest.mark.integration

NOISE_MARGIN = 1e-3  # top-1/top-2 logprob gap below which argmax may flip with batching


# The backend under test, as the tests' id (deploy/gpu-check-offline.sh selects them
# with -k native): the session's shared engine.
@pytest.fixture(scope="module", params=["native"])
def served(engine_server: ManagedProcess) -> ManagedProcess:
    return engine_server


@pytest.fixture(scope="module")
def stub(served: ManagedProcess) -> Iterator[engine_pb2_grpc.EngineStub]:
    with grpc.insecure_channel(served.address) as ch:
        yield engine_pb2_grpc.EngineStub(ch)


@pytest.fixture(scope="module")
def native_stub(engine_server: ManagedProcess) -> Iterator[engine_pb2_grpc.EngineStub]:
    """The same engine outside the ``served`` id: what -k native leaves out."""
    with grpc.insecure_channel(engine_server.address) as ch:
        yield engine_pb2_grpc.EngineStub(ch)


@pytest.fixture(scope="module")
def tok(model_dir: Path) -> TextTokenizer:
    return TextTokenizer(model_dir)


def request(
    rid: str, ids: list[int], max_tokens: int, **kw: Any
) -> engine_pb2.EngineGenerateRequest:
    return engine_pb2.EngineGenerateRequest(
        request_id=rid,
        prompt_token_ids=ids,
        sampling=engine_pb2.EngineSamplingParams(max_tokens=max_tokens, **kw),
    )


def collect(
    stub: engine_pb2_grpc.EngineStub, req: engine_pb2.EngineGenerateRequest, timeout: float = 120
) -> tuple[list[int], list[engine_pb2.EngineGenerateResponse]]:
    chunks = list(stub.Generate(req, timeout=timeout))
    return [t for c in chunks for t in c.token_ids], chunks


def test_model_info(stub: engine_pb2_grpc.EngineStub) -> None:
    info = stub.GetModelInfo(engine_pb2.GetModelInfoRequest())
    assert info.model == "SmolLM2-135M-Instruct"
    assert info.version.startswith("sha-")
    assert (info.vocab_size, list(info.eos_token_ids), info.backend) == (49152, [2], "native")
    assert info.kv_block_size > 0
    assert info.max_context_length == 2048  # from the env override
    assert info.weight_dtype == "float32"
    assert info.device.startswith(os.environ.get("LLM_TEST_ENGINE_DEVICE", "cpu"))
    assert len(info.config_hash) == 16


PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain gravity to a child.",
    "Say hello in Spanish.",
    "What is 12 times 12?",
    "Name a famous painter.",
    "Describe a cat in one sentence.",
]


def test_concurrent_streams_match_offline_engine(
    stub: engine_pb2_grpc.EngineStub, tok: TextTokenizer, model_dir: Path
) -> None:
    """16 concurrent streams of different lengths complete; greedy tokens equal an
    offline LLMEngine's wherever the offline top-1/top-2 margin is above noise."""
    jobs = []
    for i in range(16):
        ids, _ = tok.encode_chat([Message("user", PROMPTS[i % len(PROMPTS)] + " " * (i // 8))])
        jobs.append((f"c{i}", ids, 4 + 2 * i))
    with cf.ThreadPoolExecutor(16) as pool:
        futs = [
            pool.submit(collect, stub, request(rid, ids, n, ignore_eos=True))
            for rid, ids, n in jobs
        ]
        results = [f.result() for f in futs]
    for (_, _, n), (tokens, chunks) in zip(jobs, results, strict=True):
        assert len(tokens) == n
        assert chunks[-1].finish_reason == common_pb2.LENGTH
        assert chunks[-1].usage.completion_tokens == n
        assert chunks[0].timings.time_to_first_token_seconds > 0
    device = os.environ.get("LLM_TEST_ENGINE_DEVICE", "cpu")
    offline = LLMEngine(
        EngineConfig(
            model_dir=str(model_dir),
            dtype="float32",
            device=device,
            num_kv_blocks=512,
            max_model_len=2048,
        )
    )
    for rid, ids, n in jobs:
        offline.add_request(rid, ids, SamplingParams(max_tokens=n, ignore_eos=True, logprobs=1))
    ref: dict[str, list[Any]] = {rid: [] for rid, _, _ in jobs}
    while offline.has_unfinished_requests():
        for out in offline.step():
            ref[out.request_id].extend(out.new_logprobs or [])
    for (rid, _, _), (tokens, _) in zip(jobs, results, strict=True):
        for i, lp in enumerate(ref[rid]):
            if tokens[i] != lp.token_id:
                margin = lp.logprob - lp.top_logprobs[1]
                assert margin < NOISE_MARGIN, f"{rid} diverged at {i} with margin {margin:.5f}"
                break


def test_a_repeated_prompt_is_served_from_the_prefix_cache(
    stub: engine_pb2_grpc.EngineStub,
) -> None:
    """The second request of a prompt reports its whole blocks as cached prompt tokens
    and generates the same greedy tokens."""
    block = stub.GetModelInfo(engine_pb2.GetModelInfoRequest()).kv_block_size
    ids = [(7 * i) % 4000 + 100 for i in range(2 * block + 40)]  # > two whole blocks
    first, first_chunks = collect(stub, request("pc-1", ids, 8))
    again, chunks = collect(stub, request("pc-2", ids, 8))
    assert again == first
    assert chunks[-1].usage.prompt_tokens == len(ids)
    assert chunks[-1].usage.cached_prompt_tokens >= block * (len(ids) // block - 1)
    assert first_chunks[-1].usage.cached_prompt_tokens < chunks[-1].usage.cached_prompt_tokens


def test_speculative_decoding_over_grpc(
    native_stub: engine_pb2_grpc.EngineStub, tok: TextTokenizer
) -> None:
    """Request-level prompt-lookup speculation: asking for it gives the same greedy
    tokens with drafts accepted."""
    stub = native_stub
    ids, _ = tok.encode_chat(
        [
            Message(
                "user",
                "Repeat this list exactly: apple, banana, "
                "cherry, date, elderberry, fig, grape, honeydew.",
            )
        ]
    )
    plain, _ = collect(stub, request("spec-off", ids, 20))
    req = request("spec-on", ids, 20)
    req.speculative_decoding = True
    spec, chunks = collect(stub, req)
    assert spec == plain
    last = chunks[-1]
    assert last.speculative.num_draft_tokens > 0
    assert 0 < last.speculative.num_accepted_tokens <= last.speculative.num_draft_tokens
    assert last.speculative.num_forward_passes_saved == last.speculative.num_accepted_tokens


def test_cancel_mid_stream_frees_kv_blocks(stub: engine_pb2_grpc.EngineStub) -> None:
    before = wait_for_idle(stub)
    call = stub.Generate(request("cancel-me", list(range(100, 400)), 1000, ignore_eos=True))
    got = 0
    for chunk in call:
        got += len(chunk.token_ids)
        if got >= 3:
            busy = stub.GetStats(engine_pb2.GetStatsRequest())
            assert busy.num_kv_blocks_used > before
            call.cancel()  # type: ignore[no-untyped-call]
            break
    assert wait_for_idle(stub) == before


def test_reused_live_request_id_is_refused_and_the_live_stream_is_untouched(
    stub: engine_pb2_grpc.EngineStub,
) -> None:
    """A second call with a live id gets ALREADY_EXISTS; its clean-up must not abort
    the first stream, which runs to its full length."""
    before = wait_for_idle(stub)
    first = stub.Generate(request("owned", [5, 6, 7], 40, ignore_eos=True))
    tokens: list[int] = []
    for chunk in first:
        tokens.extend(chunk.token_ids)
        if tokens:
            with pytest.raises(grpc.RpcError) as err:
                collect(stub, request("owned", [1, 2, 3], 4))
            assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
            assert "already in use" in (err.value.details() or "")
            break
    tokens.extend(t for chunk in first for t in chunk.token_ids)
    assert len(tokens) == 40
    assert wait_for_idle(stub) == before


def test_deadline_exceeded_aborts_and_frees(stub: engine_pb2_grpc.EngineStub) -> None:
    before = wait_for_idle(stub)
    with pytest.raises(grpc.RpcError) as err:
        collect(stub, request("slow", [1, 2, 3], 1500, ignore_eos=True), timeout=1.0)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert wait_for_idle(stub) == before


def test_request_deadline_field_is_honoured(stub: engine_pb2_grpc.EngineStub) -> None:
    req = request("dl-field", [1, 2, 3], 1500, ignore_eos=True)
    req.deadline.FromNanoseconds(int((time.time() + 0.8) * 1e9))
    with pytest.raises(grpc.RpcError) as err:
        collect(stub, req)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "KV blocks freed" in (err.value.details() or "")


BAD = [
    (request("b1", [], 4), "prompt_token_ids is empty"),
    (request("", [1, 2], 4), "request_id must be set"),
    (request("b2", [1, 2], 0), "max_tokens must be >= 1"),
    (request("b3", [1, 49152], 4), "outside the vocabulary"),
    (request("b4", list(range(1, 2049)), 4), "leaving no room for output"),
    (request("b5", [1, 2], 2047), "lower max_tokens to 2046"),
    (request("b6", [1, 2], 4, temperature=-1), "temperature must be a finite number >= 0"),
    (request("b7", [1, 2], 4, top_p=1.5), "top_p must be in (0, 1]"),
    (request("b8", [1, 2], 4, logprobs=50), "logprobs must be in [0, 20]"),
    (request("b9", [1, 2], 4, min_tokens=9), "must not exceed max_tokens"),
    (request("b10", [1, 2], 4, stop_token_ids=[70000]), "stop_token_ids"),
    (
        engine_pb2.EngineGenerateRequest(
            request_id="b11",
            prompt_token_ids=[1],
            model="gpt-9",
            sampling=engine_pb2.EngineSamplingParams(max_tokens=2),
        ),
        "not 'gpt-9'",
    ),
    (
        engine_pb2.EngineGenerateRequest(
            request_id="b12",
            prompt_token_ids=[1],
            tenant_weight=-2.0,
            sampling=engine_pb2.EngineSamplingParams(max_tokens=2),
        ),
        "tenant_weight must be > 0",
    ),
]


@pytest.mark.parametrize(("req", "message"), BAD, ids=[r.request_id or "empty-id" for r, _ in BAD])
def test_bad_input_is_invalid_argument(
    stub: engine_pb2_grpc.EngineStub, req: engine_pb2.EngineGenerateRequest, message: str
) -> None:
    with pytest.raises(grpc.RpcError) as err:
        collect(stub, req, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in (err.value.details() or "")


def test_stats_and_metrics(stub: engine_pb2_grpc.EngineStub, served: ManagedProcess) -> None:
    collect(stub, request("m1", [1, 2, 3], 5))
    with pytest.raises(grpc.RpcError):  # one rejection, counted by type
        collect(stub, request("m2", [], 5))
    s = stub.GetStats(engine_pb2.GetStatsRequest())
    assert s.num_kv_blocks_total == 512  # the env override
    assert s.num_requests_total >= 1
    assert s.model_version.startswith("sha-")
    wait_for_idle(stub)  # idle: no tenant's fair-share counter is kept
    assert stub.GetStats(engine_pb2.GetStatsRequest()).num_fair_share_tenants == 0
    url = f"http://127.0.0.1:{served.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as r:
        body = r.read().decode()
    for name in (
        "engine_time_to_first_token_seconds_bucket",
        "engine_num_requests_running",
        "engine_kv_cache_usage_perc",
        "engine_fair_share_tenants",
        "engine_request_success_total{finished_reason=",
        'engine_request_errors_total{error_type="invalid"',
        "engine_generation_tokens_total",
        'engine_model_info{backend="native"',
        # the same series under vLLM's names, for dashboards written for vLLM
        "vllm:num_requests_running{",
        "vllm:time_to_first_token_seconds_bucket{",
        "vllm:generation_tokens_total{",
        "vllm:kv_cache_usage_perc{",
    ):
        assert name in body, name
    series = [
        line
        for line in body.splitlines()  # the *_info series describe configs
        if line.startswith(("engine_", "vllm:")) and "_info{" not in line
    ]
    assert series
    assert all('model_name="' in line for line in series), "every engine series names its model"
    assert "# TYPE vllm:num_preemptions" in body


@pytest.fixture(scope="module")
def small_engine(
    served: ManagedProcess, model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ManagedProcess]:
    """One running slot and one waiting slot: easy to fill (``served`` for the id)."""
    proc = start_engine(
        "engine-small",
        model_dir,
        tmp_path_factory.mktemp("small-engine"),
        env={
            "LLM_ENGINE_CORE_SCHEDULER_MAX_NUM_SEQS": "1",
            "LLM_ENGINE_CORE_SCHEDULER_MAX_WAITING": "1",
            # the drain below must not race a loaded machine
            "LLM_ENGINE_GRACE_SECONDS": "60",
        },
    )
    try:
        yield proc
    finally:
        proc.stop()


def test_queue_full_is_resource_exhausted_with_retry_after(small_engine: ManagedProcess) -> None:
    with grpc.insecure_channel(small_engine.address) as ch:
        stub = engine_pb2_grpc.EngineStub(ch)
        # one at a time, so the arrival order is known: q0 runs, then q1 waits
        running = stub.Generate(request("q0", [1, 2, 3], 400, ignore_eos=True))
        assert next(iter(running)).token_ids
        waiting = stub.Generate(request("q1", [1, 2, 3], 400, ignore_eos=True))
        deadline = time.monotonic() + 30
        while stub.GetStats(engine_pb2.GetStatsRequest()).num_waiting < 1:
            assert time.monotonic() < deadline, "q1 never reached the waiting queue"
            time.sleep(0.02)
        with pytest.raises(grpc.RpcError) as err:
            collect(stub, request("q2", [1, 2, 3], 4), timeout=30)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        trailers: dict[str, Any] = dict(err.value.trailing_metadata() or ())  # type: ignore[arg-type]
        assert int(trailers["retry-after-ms"]) > 0
        for c in (running, waiting):
            c.cancel()  # type: ignore[no-untyped-call]


def test_sigterm_drains_in_flight_then_exits(small_engine: ManagedProcess) -> None:
    """In-flight streams finish within the grace period; new ones are refused."""
    with grpc.insecure_channel(small_engine.address) as ch:
        stub = engine_pb2_grpc.EngineStub(ch)
        wait_for_idle(stub)
        result: dict[str, Any] = {}

        def run() -> None:
            result["tokens"], result["chunks"] = collect(
                stub, request("drain-1", [1, 2, 3], 40, ignore_eos=True)
            )

        t = threading.Thread(target=run)
        t.start()
        deadline = time.monotonic() + 30
        while not stub.GetStats(engine_pb2.GetStatsRequest()).num_running:
            assert time.monotonic() < deadline, "drain-1 never started running"
            time.sleep(0.02)
        # to the main process only, as Kubernetes sends it
        small_engine.signal(signal.SIGTERM, group=False)
        deadline = time.monotonic() + 30  # until the engine says it handled the signal
        while '"draining"' not in small_engine.log_path.read_text():
            assert time.monotonic() < deadline, "SIGTERM never started the drain"
            time.sleep(0.02)
        with pytest.raises(grpc.RpcError) as err:
            collect(stub, request("late", [1, 2], 2), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        t.join(60)
        assert len(result["tokens"]) == 40
        assert result["chunks"][-1].finish_reason == common_pb2.LENGTH
    assert small_engine.proc is not None
    assert small_engine.proc.wait(60) == 0
    log = small_engine.log_path.read_text()
    assert '"draining"' in log
    assert '"stopped"' in log
