"""SamplingParams validation, max_tokens resolution, traceparent and request ids."""

from __future__ import annotations

import math

import grpc
import pytest

from gateway.domain import CallContext, GatewayError, new_traceparent
from gateway.request.params import (
    engine_sampling,
    request_priority,
    resolve_max_tokens,
    validate_sampling,
    validate_stop_token_ids,
)
from llm.v1 import common_pb2

VOCAB = 1000


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.inf}, "finite"),
        ({"top_p": math.nan}, "top_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 11.0}, "repetition_penalty"),
        ({"presence_penalty": -2.5}, "presence_penalty"),
        ({"top_k": VOCAB + 1}, "top_k"),
        ({"logprobs": 21}, "logprobs"),
        ({"stop": ["a"] * 17}, "at most 16"),
        ({"stop": ["x" * 257]}, "257 characters"),
    ],
)
def test_invalid_fields_name_the_field(fields: dict[str, object], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        validate_sampling(common_pb2.SamplingParams(**fields), VOCAB)  # type: ignore[arg-type]


def test_valid_params_map_to_the_engine() -> None:
    p = common_pb2.SamplingParams(
        temperature=0.7,
        top_p=0.9,
        top_k=5,
        seed=7,
        stop=["x"],
        stop_token_ids=[3],
        min_tokens=2,
        logprobs=1,
        ignore_eos=True,
    )
    validate_sampling(p, VOCAB)
    validate_stop_token_ids(p, VOCAB)
    e = engine_sampling(p, 10)
    assert (e.max_tokens, e.seed, e.top_k, list(e.stop_token_ids)) == (10, 7, 5, [3])
    assert not engine_sampling(common_pb2.SamplingParams(), 1).HasField("seed")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        validate_stop_token_ids(common_pb2.SamplingParams(stop_token_ids=[VOCAB]), VOCAB)


def test_resolve_max_tokens() -> None:
    p = common_pb2.SamplingParams
    assert resolve_max_tokens(p(), 10, 100, 256, 0) == 90  # default capped by the context
    assert resolve_max_tokens(p(), 10, 1000, 256, 0) == 256
    assert resolve_max_tokens(p(), 10, 1000, 256, 64) == 64
    assert resolve_max_tokens(p(max_tokens=5), 10, 100, 256, 0) == 5
    with pytest.raises(ValueError, match="shorten the prompt"):
        resolve_max_tokens(p(), 100, 100, 256, 0)
    with pytest.raises(ValueError, match="at most 90"):
        resolve_max_tokens(p(max_tokens=91), 10, 100, 256, 0)
    with pytest.raises(ValueError, match="allows at most 64"):
        resolve_max_tokens(p(max_tokens=65), 10, 1000, 256, 64)
    with pytest.raises(ValueError, match="min_tokens"):
        resolve_max_tokens(p(max_tokens=5, min_tokens=6), 10, 100, 256, 0)


def test_traceparent_keeps_the_trace_and_makes_a_new_span() -> None:
    incoming = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    out, trace_id = new_traceparent(incoming)
    assert trace_id == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert out.startswith("00-4bf92f3577b34da6a3ce929d0e0e4736-")
    assert out.endswith("-01")
    assert out != incoming
    for bad in (
        "",
        "garbage",
        "00-" + "0" * 32 + "-00f067aa0ba902b7-01",
        "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
    ):
        out, trace_id = new_traceparent(bad)
        assert len(trace_id) == 32
        assert out.split("-")[1] == trace_id
        assert int(trace_id, 16)


def test_request_ids() -> None:
    assert CallContext(request_id="abc").request_id == "abc"
    assert len(CallContext().request_id) == 32
    bad = CallContext(request_id="has space")
    assert bad.request_id_error
    assert bad.request_id != "has space"
    err = GatewayError(grpc.StatusCode.RESOURCE_EXHAUSTED, "x", retry_after_ms=5)
    assert ("retry-after-ms", "5") in err.metadata()


LOW, NORMAL, CRITICAL = 1, 2, 3


@pytest.mark.parametrize(
    ("asked", "tenant", "runs"),
    [
        (0, CRITICAL, CRITICAL),  # unspecified: the tenant's class
        (LOW, CRITICAL, LOW),  # batch work below the tenant's class
        (CRITICAL, NORMAL, NORMAL),  # never above it
        (CRITICAL, LOW, LOW),
        (NORMAL, NORMAL, NORMAL),
        (0, 0, NORMAL),  # a tenant without a class is NORMAL
        (CRITICAL, 0, NORMAL),
    ],
)
def test_a_request_runs_at_most_at_its_tenants_class(asked: int, tenant: int, runs: int) -> None:
    assert request_priority(asked, tenant) == runs


def test_an_unknown_priority_is_refused() -> None:
    with pytest.raises(ValueError, match="priority 7 is not one of LOW"):
        request_priority(7, NORMAL)
