"""Hypothesis-generated GenerateRequests over every proto field: a proper status, never a crash."""

from __future__ import annotations

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.procs import check_health
from llm.v1 import common_pb2, gateway_pb2
from tests.integration.gateway.conftest import GatewayProcess

pytestmark = pytest.mark.integration

EXPECTED_ERRORS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND}
text = st.text(st.characters(exclude_categories=["Cs"]), max_size=40)
floats = st.floats(width=32) | st.sampled_from([0.0, 0.5, 1.0])
small = st.integers(0, 8)
u32 = st.integers(0, 2**32 - 1)

sampling = st.builds(
    common_pb2.SamplingParams,
    max_tokens=small | u32,
    temperature=floats,
    top_p=floats,
    top_k=small | u32,
    seed=st.none() | st.integers(0, 2**64 - 1),
    stop=st.lists(text, max_size=3),
    repetition_penalty=floats,
    presence_penalty=floats,
    frequency_penalty=floats,
    min_tokens=small | u32,
    logprobs=small | u32,
    min_p=floats,
    stop_token_ids=st.lists(small | u32, max_size=3),
    ignore_eos=st.booleans(),
)
messages = st.lists(
    st.builds(
        common_pb2.ChatMessage,
        role=st.sampled_from(["user", "system", "assistant", "tool", "bogus", ""]),
        content=text,
    ),
    max_size=3,
).map(lambda ms: common_pb2.ChatMessages(messages=ms))


@st.composite
def requests(draw: st.DrawFn) -> gateway_pb2.GenerateRequest:
    req = gateway_pb2.GenerateRequest(
        model=draw(st.sampled_from(["", "SmolLM2-135M-Instruct", "nope"]) | text),
        sampling=draw(sampling),
        request_id=draw(st.sampled_from(["", "fuzz-1"]) | text),
        model_version=draw(st.sampled_from(["", "v0"])),
    )
    which = draw(st.sampled_from(["prompt", "messages", "none"]))
    if which == "prompt":
        req.prompt = draw(text)
    elif which == "messages":
        req.messages.CopyFrom(draw(messages))
    return req


@pytest.fixture(scope="module")
def key(gateway: GatewayProcess) -> str:
    return gateway.tenant()[1]


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(req=requests())
def test_any_request_gets_a_proper_status(
    gateway: GatewayProcess, key: str, req: gateway_pb2.GenerateRequest
) -> None:
    try:
        chunks = gateway.generate(key, req, timeout=60)
    except grpc.RpcError as e:
        error: grpc.RpcError | None = e
    else:
        error = None
    if error is not None:
        assert error.code() in EXPECTED_ERRORS, (error.code(), error.details(), req)
        assert error.details()
        return
    last = chunks[-1]
    assert last.finish_reason in (common_pb2.STOP, common_pb2.LENGTH)
    assert last.usage.completion_tokens == sum(len(c.token_ids) for c in chunks)
    if req.request_id:
        assert all(c.request_id == req.request_id for c in chunks)


def test_gateway_still_serving_after_fuzz(gateway: GatewayProcess) -> None:
    assert check_health(gateway.proc.address)
    assert "Traceback" not in gateway.proc.log_path.read_text()
