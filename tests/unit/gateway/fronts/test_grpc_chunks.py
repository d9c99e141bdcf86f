"""The gRPC front's chunks carry the pipeline's tool call deltas and thought."""

from __future__ import annotations

from gateway.domain import Chunk
from gateway.fronts.grpc_servicer import chunk_to_proto
from llm.v1 import common_pb2


def test_tool_calls_and_reasoning_go_into_the_response() -> None:
    calls = [
        common_pb2.ToolCall(index=0, id="call_1", type="function", name="now"),
        common_pb2.ToolCall(index=0, arguments="{}"),
    ]
    resp = chunk_to_proto(
        Chunk("r", tool_calls=calls, reasoning_text="hm", finish_reason=common_pb2.TOOL_CALLS)
    )
    assert list(resp.tool_calls) == calls
    assert resp.reasoning_text == "hm"
    assert resp.finish_reason == common_pb2.TOOL_CALLS
