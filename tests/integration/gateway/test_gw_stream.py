"""The gateway over real services: streaming, chat, stop strings, auth, bad input, models."""

from __future__ import annotations

import json
import math
import time

import grpc
import pytest

from llm.v1 import admin_pb2, common_pb2, gateway_pb2
from tests.integration.gateway.conftest import ADMIN_KEY, GatewayProcess, chat
from tokenizer_svc.chat_template import Message
from tokenizer_svc.tokenizer import TextTokenizer

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def key(gateway: GatewayProcess) -> str:
    return gateway.tenant()[1]


def rpc_error(fn: object, *args: object, **kw: object) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        fn(*args, **kw)  # type: ignore[operator]
    return info.value


def test_stream_happy_path(gateway: GatewayProcess, key: str, tok: TextTokenizer) -> None:
    req = chat("What is the capital of France?", max_tokens=12, ignore_eos=True)
    req.request_id = "happy-path-1"
    call = gateway.stub.Generate(req, metadata=(("authorization", f"Bearer {key}"),), timeout=60)
    chunks = list(call)
    ids = [t for c in chunks for t in c.token_ids]
    assert len(ids) == 12
    assert "".join(c.text for c in chunks) == tok.decode(ids)
    assert len(chunks) >= 2  # streamed, not one blob
    assert all(c.request_id == "happy-path-1" for c in chunks)
    assert all(c.finish_reason == 0 for c in chunks[:-1])
    last = chunks[-1]
    assert last.finish_reason == common_pb2.LENGTH
    prompt_ids, _ = tok.encode_chat([Message("user", "What is the capital of France?")])
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(prompt_ids), 12)
    assert chunks[0].model == "SmolLM2-135M-Instruct"
    assert chunks[0].model_version
    assert dict(call.initial_metadata())["x-request-id"] == "happy-path-1"


def test_prompt_input_and_generated_request_id(
    gateway: GatewayProcess, key: str, tok: TextTokenizer
) -> None:
    req = gateway_pb2.GenerateRequest(
        prompt="The capital of France is", sampling=common_pb2.SamplingParams(max_tokens=5)
    )
    chunks = gateway.generate(key, req)
    ids = [t for c in chunks for t in c.token_ids]
    assert "".join(c.text for c in chunks) == tok.decode(ids)
    assert len(chunks[0].request_id) == 32
    assert chunks[-1].usage.completion_tokens == len(ids)
    assert chunks[-1].usage.prompt_tokens == len(tok.encode("The capital of France is"))


def test_default_max_tokens_and_eos(gateway: GatewayProcess, key: str) -> None:
    chunks = gateway.generate(key, chat("Say hi.", max_tokens=0))
    assert 1 <= chunks[-1].usage.completion_tokens <= 16  # default_max_tokens of the suite
    assert chunks[-1].finish_reason in (common_pb2.STOP, common_pb2.LENGTH)


def test_stop_string_is_trimmed(gateway: GatewayProcess, key: str) -> None:
    full = "".join(
        c.text
        for c in gateway.generate(
            key, chat("Count from one to ten in words.", max_tokens=24, ignore_eos=True)
        )
    )
    words = full.split()
    assert len(words) > 3, full
    stop = words[2]
    chunks = gateway.generate(
        key, chat("Count from one to ten in words.", max_tokens=24, ignore_eos=True, stop=[stop])
    )
    text = "".join(c.text for c in chunks)
    assert text == full[: full.index(stop)]
    assert chunks[-1].finish_reason == common_pb2.STOP
    assert chunks[-1].usage.completion_tokens < 24


def test_logprobs_carry_token_text(gateway: GatewayProcess, key: str, tok: TextTokenizer) -> None:
    chunks = gateway.generate(key, chat("Hi", max_tokens=3, logprobs=2, ignore_eos=True))
    lps = [lp for c in chunks for lp in c.logprobs]
    ids = [t for c in chunks for t in c.token_ids]
    assert [lp.chosen.token_id for lp in lps] == ids
    assert all(len(lp.top) == 2 and lp.chosen.text and lp.chosen.logprob <= 0 for lp in lps)


def test_list_models(gateway: GatewayProcess, key: str) -> None:
    resp = gateway.stub.ListModels(
        gateway_pb2.ListModelsRequest(), metadata=(("authorization", f"Bearer {key}"),)
    )
    (card,) = resp.models
    assert card.id == "SmolLM2-135M-Instruct"
    assert card.max_context_length == 2048
    assert sum(v.num_replicas for v in card.versions) == 2
    assert (
        rpc_error(gateway.stub.ListModels, gateway_pb2.ListModelsRequest()).code()
        == grpc.StatusCode.UNAUTHENTICATED
    )


@pytest.mark.parametrize(
    ("authorization", "code", "words"),
    [
        (None, grpc.StatusCode.UNAUTHENTICATED, "missing API key"),
        ("Basic abc", grpc.StatusCode.UNAUTHENTICATED, "Bearer"),
        ("Bearer sk-llm-" + "x" * 40, grpc.StatusCode.UNAUTHENTICATED, "unknown API key"),
        ("Bearer not-a-key", grpc.StatusCode.UNAUTHENTICATED, "malformed"),
    ],
)
def test_bad_keys(
    gateway: GatewayProcess, authorization: str | None, code: grpc.StatusCode, words: str
) -> None:
    md = (("authorization", authorization),) if authorization else ()
    # invalid params too: authentication comes before any other check
    req = chat("hi", max_tokens=10**6, temperature=-1)
    err = rpc_error(lambda: list(gateway.stub.Generate(req, metadata=md, timeout=30)))
    assert err.code() == code
    assert words in (err.details() or "")


def test_revoked_key_admin_key_and_model_not_allowed(gateway: GatewayProcess) -> None:
    tid, key = gateway.tenant()
    assert gateway.generate(key, chat("hi", max_tokens=1))[-1].finish_reason
    keys = gateway.admin.ListApiKeys(
        admin_pb2.ListApiKeysRequest(tenant_id=tid), metadata=gateway.admin_md
    ).api_keys
    gateway.admin.RevokeApiKey(
        admin_pb2.RevokeApiKeyRequest(key_id=keys[0].key_id), metadata=gateway.admin_md
    )
    err = rpc_error(gateway.generate, key, chat("hi"))
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "revoked" in (err.details() or "")
    err = rpc_error(gateway.generate, ADMIN_KEY, chat("hi"))
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "ADMIN key" in (err.details() or "")
    gateway.admin.UpsertTenant(
        admin_pb2.Tenant(id="only-other", allowed_models=["other"]), metadata=gateway.admin_md
    )
    key2 = gateway.admin.CreateApiKey(
        admin_pb2.CreateApiKeyRequest(tenant_id="only-other"), metadata=gateway.admin_md
    ).key
    err = rpc_error(gateway.generate, key2, chat("hi"))
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "may not use model" in (err.details() or "")
    err = rpc_error(
        gateway.admin.ListTenants,
        admin_pb2.ListTenantsRequest(),
        metadata=(("authorization", f"Bearer {key2}"),),
    )
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED


BAD_INPUTS = [
    (chat("hi", temperature=-0.5), "temperature"),
    (chat("hi", temperature=math.nan), "temperature"),
    (chat("hi", top_p=1.5), "top_p"),
    (chat("hi", top_k=10**6), "top_k"),
    (chat("hi", presence_penalty=3.0), "presence_penalty"),
    (chat("hi", frequency_penalty=-math.inf), "frequency_penalty"),
    (chat("hi", repetition_penalty=-1.0), "repetition_penalty"),
    (chat("hi", min_p=2.0), "min_p"),
    (chat("hi", logprobs=50), "logprobs"),
    (chat("hi", max_tokens=65), "at most 64"),
    (chat("hi", max_tokens=8, min_tokens=9), "min_tokens"),
    (chat("hi", stop=[""]), "stop[0]"),
    (chat("hi", stop_token_ids=[10**6]), "stop_token_ids"),
    (gateway_pb2.GenerateRequest(), "prompt"),
    (gateway_pb2.GenerateRequest(prompt=""), "empty"),
    (gateway_pb2.GenerateRequest(messages=common_pb2.ChatMessages()), "messages is empty"),
    (gateway_pb2.GenerateRequest(prompt="hello " * 2100), "context"),
    (gateway_pb2.GenerateRequest(prompt="hi", request_id="has space"), "request_id"),
]


@pytest.mark.parametrize(("req", "words"), BAD_INPUTS)
def test_invalid_argument(
    gateway: GatewayProcess, key: str, req: gateway_pb2.GenerateRequest, words: str
) -> None:
    err = rpc_error(gateway.generate, key, req)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert words in (err.details() or ""), err.details()


def test_unknown_model_and_version(gateway: GatewayProcess, key: str) -> None:
    err = rpc_error(gateway.generate, key, gateway_pb2.GenerateRequest(model="gpt-9", prompt="x"))
    assert err.code() == grpc.StatusCode.NOT_FOUND
    assert "SmolLM2-135M-Instruct" in (err.details() or "")
    err = rpc_error(
        gateway.generate,
        key,
        gateway_pb2.GenerateRequest(model="SmolLM2-135M-Instruct", model_version="v0", prompt="x"),
    )
    assert err.code() == grpc.StatusCode.NOT_FOUND
    assert "sha-" in (err.details() or "")


def test_request_id_and_trace_reach_logs(gateway: GatewayProcess, key: str) -> None:
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    gateway.generate(
        key,
        chat("hi", max_tokens=2),
        metadata=(
            ("traceparent", f"00-{trace_id}-00f067aa0ba902b7-01"),
            ("x-request-id", "trace-me-1"),
        ),
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        lines = [
            json.loads(line)
            for line in gateway.proc.log_path.read_text().splitlines()
            if "trace-me-1" in line
        ]
        settled = [rec for rec in lines if rec.get("event") == "request settled"]
        if settled:
            break
        time.sleep(0.1)
    assert settled[0]["trace_id"] == trace_id
    assert settled[0]["tenant"]


def settled_metric(
    gateway: GatewayProcess, name: str, labels: dict[str, str], expected: float
) -> float:
    """The value of a counter once it reaches ``expected`` (a request is counted as it
    settles, just after its last chunk), or what it holds 10 s later."""
    deadline = time.monotonic() + 10
    value = gateway.metric(name, **labels)
    while value < expected and time.monotonic() < deadline:
        time.sleep(0.05)
        value = gateway.metric(name, **labels)
    return value


def test_metrics_names(gateway: GatewayProcess, key: str) -> None:
    # every count is read before and after this test's own requests, so it holds
    # whichever tests ran before it (or none)
    requests_ok = gateway.metric("gateway_requests_total", code="OK")
    invalid = gateway.metric("gateway_requests_total", code="INVALID_ARGUMENT")
    completion = gateway.metric("gateway_tokens_charged_total", kind="completion")
    gateway.generate(key, chat("hi", max_tokens=2, ignore_eos=True))
    err = rpc_error(gateway.generate, key, chat("hi", max_tokens=65))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    text = gateway.metrics()
    for name in (
        "gateway_requests_total",
        "gateway_tokens_charged_total",
        "gateway_time_to_first_token_seconds",
        "gateway_e2e_latency_seconds",
        "gateway_overhead_seconds",
        "gateway_retries_total",
        "gateway_failovers_total",
        "gateway_breaker_state",
        "gateway_ratelimit_denials_total",
    ):
        assert name in text, name
    expected = {
        ("gateway_requests_total", "code", "OK"): requests_ok + 1,
        ("gateway_requests_total", "code", "INVALID_ARGUMENT"): invalid + 1,
        ("gateway_tokens_charged_total", "kind", "completion"): completion + 2,
    }
    for (name, label, value), want in expected.items():
        assert settled_metric(gateway, name, {label: value}, want) == want, (name, value)
