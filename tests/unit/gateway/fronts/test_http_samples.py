"""n > 1 on the HTTP front: one choice per sample, streamed interleaved; usage counts the
prompt once and every sample's output."""

from __future__ import annotations

import grpc

from gateway.domain import Chunk, GatewayError
from gateway.fronts.http.errors import ApiError
from gateway.fronts.http.requests import parse
from gateway.fronts.http.responses import Formatter
from llm.v1 import common_pb2

MSGS = [{"role": "user", "content": "hi"}]


def samples() -> list[Chunk]:
    def usage(n: int) -> common_pb2.Usage:
        return common_pb2.Usage(prompt_tokens=7, completion_tokens=n, cached_prompt_tokens=3)

    return [
        Chunk("r", text="a", index=1),
        Chunk("r", text="x", index=0),
        Chunk("r", text="b", index=1, finish_reason=common_pb2.STOP, usage=usage(2)),
        Chunk("r", text="y", index=0, finish_reason=common_pb2.LENGTH, usage=usage(5)),
    ]


def test_each_sample_is_a_choice() -> None:
    parsed = parse({"messages": MSGS, "n": 2}, chat=True)
    assert parsed.request.n == 2
    fmt = Formatter(parsed, "rid", "m")
    for c in samples():
        fmt.add(c)
    body = fmt.final()
    assert [(c["index"], c["message"]["content"], c["finish_reason"]) for c in body["choices"]] == [
        (0, "xy", "length"),
        (1, "ab", "stop"),
    ]
    assert body["usage"]["prompt_tokens"] == 7
    assert body["usage"]["completion_tokens"] == 7
    assert body["usage"]["total_tokens"] == 14


def test_streamed_samples_name_their_choice() -> None:
    fmt = Formatter(parse({"messages": MSGS, "n": 2, "stream": True}, chat=True), "rid", "m")
    roles = fmt.role_chunks()
    assert [r["choices"][0]["index"] for r in roles] == [0, 1]
    objs = [o for c in samples() for o in fmt.stream_chunk(c)]
    assert [(o["choices"][0]["index"], o["choices"][0]["delta"]["content"]) for o in objs] == [
        (1, "a"),
        (0, "x"),
        (1, "b"),
        (0, "y"),
    ]
    text = parse({"prompt": "p", "n": 2}, chat=False)
    fmt = Formatter(text, "rid", "m")
    for c in samples():
        fmt.add(c)
    assert [c["text"] for c in fmt.final()["choices"]] == ["xy", "ab"]


def test_too_many_samples_name_n() -> None:
    e = GatewayError(grpc.StatusCode.INVALID_ARGUMENT, "n is 9; this gateway serves at most 8")
    assert ApiError.from_gateway(e).param == "n"
