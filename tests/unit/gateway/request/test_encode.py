"""Prompt encoding: the size check before any tokenizer call, in-process encoding of
prompts and chat messages, the errors a caller gets, and the tokenizer service path."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from gateway.domain import CallContext, Deadline, GatewayError
from gateway.request.encode import MAX_CHARS_PER_TOKEN, Encoder, check_prompt_size
from llm.v1 import common_pb2, gateway_pb2
from tokenizer_svc.tokenizer import TextTokenizer


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> TextTokenizer:
    return TextTokenizer(model_dir)


def chat(*turns: tuple[str, str]) -> gateway_pb2.GenerateRequest:
    req = gateway_pb2.GenerateRequest()
    for role, content in turns:
        req.messages.messages.add(role=role, content=content)
    return req


def test_a_prompt_no_context_could_hold_is_refused_by_its_length() -> None:
    most = 10 * MAX_CHARS_PER_TOKEN  # a context of 10 tokens
    check_prompt_size(gateway_pb2.GenerateRequest(prompt="x" * most), 10)
    with pytest.raises(GatewayError) as info:
        check_prompt_size(gateway_pb2.GenerateRequest(prompt="x" * (most + 1)), 10)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(GatewayError):  # chat messages count their roles and contents
        check_prompt_size(chat(("user", "x" * most)), 10)


async def test_in_process_a_prompt_and_messages_encode_with_the_models_tokenizer(
    tokenizer: TextTokenizer,
) -> None:
    encoder = Encoder("127.0.0.1:1")
    try:
        ids = await encoder.encode(
            gateway_pb2.GenerateRequest(prompt="Hello there"), CallContext(), Deadline(5), tokenizer
        )
        assert ids == tokenizer.encode("Hello there")
        templated = await encoder.encode(
            chat(("user", "Hello there")), CallContext(), Deadline(5), tokenizer
        )
        assert len(templated) > len(ids)  # the chat template around the message
        assert tokenizer.decode(templated).count("Hello there") == 1
    finally:
        await encoder.close()


@pytest.mark.parametrize(
    ("req", "says"),
    [
        (gateway_pb2.GenerateRequest(), "set either `prompt` or `messages`"),
        (
            gateway_pb2.GenerateRequest(messages=common_pb2.ChatMessages()),
            "messages is empty",
        ),
    ],
)
async def test_a_request_without_input_is_invalid(
    tokenizer: TextTokenizer, req: gateway_pb2.GenerateRequest, says: str
) -> None:
    encoder = Encoder("127.0.0.1:1")
    try:
        with pytest.raises(GatewayError) as info:
            await encoder.encode(req, CallContext(), Deadline(5), tokenizer)
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert says in info.value.message
    finally:
        await encoder.close()


async def test_a_tokenizer_service_that_cannot_be_reached_is_unavailable_naming_it(
    tokenizer: TextTokenizer,
) -> None:
    encoder = Encoder("127.0.0.1:1", timeout_s=2.0, in_process=False)
    try:
        with pytest.raises(GatewayError) as info:
            await encoder.encode(
                gateway_pb2.GenerateRequest(prompt="hi"), CallContext(), Deadline(5), tokenizer
            )
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
        assert "127.0.0.1:1" in info.value.message
    finally:
        await encoder.close()
