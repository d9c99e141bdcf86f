"""The OpenAI front's pure parts: body -> GenerateRequest, Chunk -> objects, error mapping, SSE."""

from __future__ import annotations

import json
from typing import Any

import grpc
import pytest

from gateway.domain import Chunk, GatewayError
from gateway.fronts.http.errors import ApiError
from gateway.fronts.http.requests import parse
from gateway.fronts.http.responses import Formatter
from gateway.fronts.http.sse import DONE, encode_event
from llm.v1 import common_pb2

MSGS = [{"role": "user", "content": "hi"}]


def test_chat_body_maps_every_sampling_field() -> None:
    p = parse(
        {
            "model": "m",
            "messages": [
                {"role": "developer", "content": "be brief"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
            ],
            "max_completion_tokens": 7,
            "max_tokens": 99,
            "temperature": 0.5,
            "top_p": 0.9,
            "seed": -1,
            "stop": "END",
            "presence_penalty": 0.1,
            "frequency_penalty": -0.2,
            "logprobs": True,
            "top_logprobs": 3,
            "user": "u1",
            "top_k": 5,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        chat=True,
    )
    r, s = p.request, p.request.sampling
    assert r.model == "m"
    assert [(m.role, m.content) for m in r.messages.messages] == [
        ("system", "be brief"),
        ("user", "ab"),
    ]
    assert s.max_tokens == 7  # max_completion_tokens wins
    assert s.temperature == pytest.approx(0.5)
    assert s.top_p == pytest.approx(0.9)
    assert s.seed == (1 << 64) - 1
    assert list(s.stop) == ["END"]
    assert (s.top_k, s.ignore_eos, s.logprobs) == (5, True, 3)
    assert (p.stream, p.include_usage, p.logprobs, p.top_logprobs, p.user) == (
        True,
        True,
        True,
        3,
        "u1",
    )


def test_defaults_follow_openai() -> None:
    p = parse({"messages": MSGS}, chat=True)
    s = p.request.sampling
    assert s.temperature == 1.0  # OpenAI's default, not greedy
    assert (s.max_tokens, s.logprobs, s.HasField("seed")) == (0, 0, False)
    assert not p.stream
    chosen_only = parse({"messages": MSGS, "logprobs": True}, chat=True)
    assert chosen_only.request.sampling.logprobs == 1  # the engine needs one alternative
    assert chosen_only.top_logprobs == 0
    text = parse({"prompt": ["one prompt"], "logprobs": 0}, chat=False)
    assert text.request.prompt == "one prompt"
    assert (text.logprobs, text.request.sampling.logprobs) == (True, 1)


@pytest.mark.parametrize(
    ("body", "chat", "param"),
    [
        ({"messages": MSGS, "n": "two"}, True, "n"),
        ({"messages": MSGS, "n": 0}, True, "n"),
        ({"messages": []}, True, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, True, "messages[0].role"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            True,
            "messages[0].content[0]",
        ),
        ({"messages": MSGS, "temperature": "hot"}, True, "temperature"),
        ({"messages": MSGS, "temperature": True}, True, "temperature"),
        ({"messages": MSGS, "temperature": 10**400}, True, "temperature"),  # no float holds it
        ({"messages": MSGS, "top_p": -(10**400)}, True, "top_p"),
        ({"messages": MSGS, "max_tokens": 0}, True, "max_tokens"),
        ({"messages": MSGS, "max_tokens": 2.5}, True, "max_tokens"),
        ({"messages": MSGS, "stop": [1]}, True, "stop"),
        ({"messages": MSGS, "top_logprobs": 2}, True, "top_logprobs"),
        ({"messages": MSGS, "top_logprobs": 21, "logprobs": True}, True, "top_logprobs"),
        ({"messages": MSGS, "stream_options": {"include_usage": True}}, True, "stream_options"),
        ({"messages": MSGS, "tools": [{"type": "function"}]}, True, "tools[0]"),
        ({"messages": MSGS, "response_format": {"type": "xml"}}, True, "response_format.type"),
        ({"messages": MSGS, "logit_bias": {"1": 5}}, True, "logit_bias"),
        ({"prompt": [1, 2]}, False, "prompt"),
        ({"prompt": "x", "echo": True}, False, "echo"),
        ({"prompt": "x", "best_of": 2}, False, "best_of"),
        ({"messages": MSGS, "priority": "urgent"}, True, "priority"),
        ({"messages": MSGS, "priority": 0}, True, "priority"),  # vLLM's integers: not ours
        ([], True, None),
    ],
)
def test_bad_bodies_name_their_param(body: Any, chat: bool, param: str | None) -> None:
    with pytest.raises(ApiError) as info:
        parse(body, chat=chat)
    assert info.value.status == 400
    assert info.value.param == param, info.value.message


@pytest.mark.parametrize(
    ("code", "status", "etype"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error"),
        (grpc.StatusCode.UNAUTHENTICATED, 401, "authentication_error"),
        (grpc.StatusCode.PERMISSION_DENIED, 403, "permission_error"),
        (grpc.StatusCode.NOT_FOUND, 404, "invalid_request_error"),
        (grpc.StatusCode.UNAVAILABLE, 503, "service_unavailable"),
        (grpc.StatusCode.DEADLINE_EXCEEDED, 504, "timeout_error"),
        (grpc.StatusCode.INTERNAL, 500, "server_error"),
    ],
)
def test_status_mapping(code: grpc.StatusCode, status: int, etype: str) -> None:
    e = ApiError.from_gateway(GatewayError(code, "why"))
    assert (e.status, e.type) == (status, etype)
    assert set(e.body()["error"]) == {"message", "type", "param", "code"}


def test_tenant_limit_full_engines_and_the_auth_throttle_are_429_with_retry_after() -> None:
    tenant = ApiError.from_gateway(
        GatewayError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "limit",
            retry_after_ms=1500,
            trailers=(("grpc-status-details-bin", b"x"),),
        )
    )
    assert tenant.status == 429
    assert tenant.headers() == {
        "Retry-After": "2",
        "retry-after-ms": "1500",
        "x-should-retry": "true",
    }
    never = ApiError.from_gateway(
        GatewayError(grpc.StatusCode.RESOURCE_EXHAUSTED, "never fits", trailers=(("k", "v"),))
    )
    assert never.headers() == {"x-should-retry": "false"}
    engines = ApiError.from_gateway(
        GatewayError(grpc.StatusCode.RESOURCE_EXHAUSTED, "full", retry_after_ms=200)
    )
    assert (engines.status, engines.code) == (429, "engine_overloaded")
    assert engines.headers()["Retry-After"] == "1"
    throttled = ApiError.from_gateway(
        GatewayError(
            grpc.StatusCode.RESOURCE_EXHAUSTED, "too many failed authentications from 1.2.3.4"
        )
    )
    assert (throttled.status, throttled.code) == (429, "auth_throttled")
    assert throttled.headers()["retry-after-ms"] == "1000"  # a wait even when none was given


@pytest.mark.parametrize(
    ("message", "chat", "param"),
    [
        ("sampling.temperature must be in [0, 2], got 5", True, "temperature"),
        ("sampling.logprobs must be in [0, 20], got 30", True, "top_logprobs"),
        ("sampling.logprobs must be in [0, 20], got 30", False, "logprobs"),
        ("prompt (10 tokens) + max_tokens (9999) exceeds the model's context", True, "max_tokens"),
        ("the prompt is 5000 tokens; the model's context is 2048", False, "prompt"),
        ("messages is empty: send at least one chat message", True, "messages"),
    ],
)
def test_pipeline_messages_name_the_openai_param(message: str, chat: bool, param: str) -> None:
    e = ApiError.from_gateway(GatewayError(grpc.StatusCode.INVALID_ARGUMENT, message), chat=chat)
    assert e.param == param
    assert "sampling." not in e.message


def _pos(tid: int, text: str, lp: float) -> common_pb2.PositionLogprobs:
    chosen = common_pb2.TokenLogprob(token_id=tid, logprob=lp, text=text)
    alt = common_pb2.TokenLogprob(token_id=tid + 1, logprob=lp - 1, text=text + "?")
    return common_pb2.PositionLogprobs(chosen=chosen, rank=1, top=[chosen, alt])


def test_streamed_chat_objects() -> None:
    p = parse(
        {
            "messages": MSGS,
            "stream": True,
            "stream_options": {"include_usage": True},
            "logprobs": True,
            "top_logprobs": 1,
        },
        chat=True,
    )
    f = Formatter(p, "rid", "")
    [role] = f.role_chunks()
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert role["usage"] is None
    [first] = f.stream_chunk(
        Chunk("rid", text="He", token_ids=[1], logprobs=[_pos(1, "He", -0.5)], model="m")
    )
    assert first["model"] == "m"
    assert first["id"] == "chatcmpl-rid"
    (c,) = first["choices"][0]["logprobs"]["content"]
    assert (c["token"], c["bytes"], len(c["top_logprobs"])) == ("He", [72, 101], 1)
    assert f.stream_chunk(Chunk("rid")) == []  # nothing to show
    usage = common_pb2.Usage(prompt_tokens=3, completion_tokens=2, cached_prompt_tokens=1)
    [last] = f.stream_chunk(
        Chunk("rid", text="y", token_ids=[2], finish_reason=common_pb2.STOP, usage=usage)
    )
    assert last["choices"][0]["finish_reason"] == "stop"
    tail = f.usage_chunk()
    assert tail["choices"] == []
    assert tail["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 2,
        "total_tokens": 5,
        "prompt_tokens_details": {"cached_tokens": 1},
    }
    assert f.final()["choices"][0]["message"] == {"role": "assistant", "content": "Hey"}


def test_text_completion_logprobs_have_offsets() -> None:
    f = Formatter(parse({"prompt": "x", "logprobs": 1}, chat=False), "r", "m")
    f.add(Chunk("r", text="ab", token_ids=[1, 2], logprobs=[_pos(1, "a", -1), _pos(2, "b", -2)]))
    f.add(
        Chunk(
            "r",
            text="c",
            token_ids=[3],
            logprobs=[_pos(3, "c", -3)],
            finish_reason=common_pb2.LENGTH,
        )
    )
    out = f.final()
    (choice,) = out["choices"]
    assert (out["id"], out["object"], choice["text"]) == ("cmpl-r", "text_completion", "abc")
    assert choice["finish_reason"] == "length"
    lp = choice["logprobs"]
    assert lp["tokens"] == ["a", "b", "c"]
    assert lp["text_offset"] == [0, 1, 2]
    assert lp["top_logprobs"][1] == {"b": -2.0}


def test_sse_event_encoding() -> None:
    ev = encode_event({"a": "é\n"})
    assert ev.startswith(b"data: ")
    assert ev.endswith(b"\n\n")
    assert ev.count(b"\n") == 2  # a newline inside the JSON is escaped
    assert json.loads(ev[6:]) == {"a": "é\n"}
    assert DONE == b"data: [DONE]\n\n"


def test_priority_extension() -> None:
    assert parse({"messages": MSGS}, chat=True).request.priority == 0  # the tenant's class
    for name, value in (("low", 1), ("Normal", 2), ("CRITICAL", 3)):
        assert parse({"prompt": "x", "priority": name}, chat=False).request.priority == value
