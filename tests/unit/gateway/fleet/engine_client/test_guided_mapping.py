"""llm.v1 GuidedDecoding through the stock-engine clients: each constraint lands in
VllmEngine's oneof and TrtllmService's guided_decoding, and reads back (through the
engine's own standard servers' translation) as the constraint it was; what a standard
protocol cannot carry (Lark, a resumed guided stream) is refused naming the field."""

from __future__ import annotations

import json

import grpc
import pytest
from smg_grpc_proto.generated import trtllm_service_pb2  # type: ignore[import-untyped]

from engine_svc.convert import guided_from_proto
from engine_svc.core.guided import GuidedSpec
from engine_svc.standard.trtllm_service import guided_from_trtllm
from engine_svc.standard.vllm_engine import guided_from_vllm
from gateway.fleet.engine_client import trtllm, vllm
from llm.v1 import common_pb2, engine_pb2

SCHEMA = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}})
CASES = [
    common_pb2.GuidedDecoding(json_schema=SCHEMA),
    common_pb2.GuidedDecoding(json_object=True),
    common_pb2.GuidedDecoding(regex=r"\d{3}"),
    common_pb2.GuidedDecoding(grammar='root ::= "yes" | "no"'),
    common_pb2.GuidedDecoding(choice=common_pb2.ChoiceList(choices=["red", 'say "hi"'])),
    common_pb2.GuidedDecoding(structural_tag='{"structures": [], "triggers": []}'),
]


def request(
    guided: common_pb2.GuidedDecoding, resumed: list[int] | None = None
) -> engine_pb2.EngineGenerateRequest:
    return engine_pb2.EngineGenerateRequest(
        request_id="g",
        prompt_token_ids=[1, 2, 3],
        sampling=engine_pb2.EngineSamplingParams(max_tokens=8, guided=guided),
        resumed_output_token_ids=resumed or [],
    )


@pytest.mark.parametrize("guided", CASES, ids=lambda g: g.WhichOneof("constraint"))
def test_vllm_carries_every_constraint_as_it_was(guided: common_pb2.GuidedDecoding) -> None:
    params = vllm.sampling_params(request(guided), "e")
    assert guided_from_vllm(params) == guided_from_proto(guided)


@pytest.mark.parametrize("guided", CASES, ids=lambda g: g.WhichOneof("constraint"))
def test_trtllm_carries_every_constraint(guided: common_pb2.GuidedDecoding) -> None:
    req = trtllm.generate_request(request(guided), "e")
    back = guided_from_trtllm(req)
    kind = guided.WhichOneof("constraint")
    if kind == "json_object":
        assert back == GuidedSpec("json_schema", '{"type": "object"}')
    elif kind == "choice":  # an EBNF grammar of the quoted options
        assert back == GuidedSpec("grammar", 'root ::= "red" | "say \\"hi\\""')
    else:
        assert back == guided_from_proto(guided)


def test_unconstrained_requests_carry_no_constraint() -> None:
    plain = request(common_pb2.GuidedDecoding())
    assert vllm.sampling_params(plain, "e").WhichOneof("constraint") is None
    assert not trtllm.generate_request(plain, "e").HasField("guided_decoding")
    off = request(common_pb2.GuidedDecoding(json_object=False))
    assert vllm.sampling_params(off, "e").WhichOneof("constraint") is None


@pytest.mark.parametrize("client", [vllm.generate_request, trtllm.generate_request])
def test_lark_and_resumed_guided_streams_are_refused_naming_the_field(client: object) -> None:
    lark = request(common_pb2.GuidedDecoding(lark_grammar='start: "a"'))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        client(lark, "e")  # type: ignore[operator]
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling.guided.lark_grammar" in (info.value.details() or "")
    resumed = request(common_pb2.GuidedDecoding(regex="a+"), resumed=[5])
    with pytest.raises(grpc.aio.AioRpcError) as info:
        client(resumed, "e")  # type: ignore[operator]
    assert "sampling.guided.regex" in (info.value.details() or "")


def test_trtllm_unspecified_guide_type_is_refused() -> None:
    req = trtllm_service_pb2.GenerateRequest(
        guided_decoding=trtllm_service_pb2.GuidedDecodingParams(guide="x")
    )
    with pytest.raises(ValueError, match=r"guided_decoding\.guide_type"):
        guided_from_trtllm(req)
