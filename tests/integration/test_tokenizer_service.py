"""The real tokenizer service, started as a subprocess on a free port, over gRPC."""

from __future__ import annotations

import signal
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from common.procs import ManagedProcess
from llm.v1 import common_pb2, tokenizer_pb2, tokenizer_pb2_grpc
from tokenizer_svc.chat_template import Message
from tokenizer_svc.tokenizer import TextTokenizer

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def channel(tokenizer_server: ManagedProcess) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(tokenizer_server.address) as ch:
        yield ch


@pytest.fixture(scope="module")
def stub(channel: grpc.Channel) -> tokenizer_pb2_grpc.TokenizerStub:
    return tokenizer_pb2_grpc.TokenizerStub(channel)


@pytest.fixture(scope="module")
def local(model_dir: Path) -> TextTokenizer:
    return TextTokenizer(model_dir)


def chat(*pairs: tuple[str, str]) -> common_pb2.ChatMessages:
    return common_pb2.ChatMessages(
        messages=[common_pb2.ChatMessage(role=r, content=c) for r, c in pairs]
    )


def test_encode_text_and_chat(stub: tokenizer_pb2_grpc.TokenizerStub, local: TextTokenizer) -> None:
    text = "Bonjour, 世界! 🎉 def f(): pass"
    assert list(stub.Encode(tokenizer_pb2.EncodeRequest(text=text)).token_ids) == local.encode(text)
    resp = stub.Encode(
        tokenizer_pb2.EncodeRequest(
            messages=chat(("user", "What is the capital of France?")), return_text=True
        )
    )
    ids, rendered = local.encode_chat([Message("user", "What is the capital of France?")])
    assert list(resp.token_ids) == ids
    assert resp.text == rendered
    assert rendered.endswith("<|im_start|>assistant\n")
    no_gen = stub.Encode(
        tokenizer_pb2.EncodeRequest(
            messages=chat(("user", "hi")), add_generation_prompt=False, return_text=True
        )
    )
    assert not no_gen.text.endswith("assistant\n")


def test_count_batch_and_decode(
    stub: tokenizer_pb2_grpc.TokenizerStub, local: TextTokenizer
) -> None:
    texts = ["one", "deux trois", "四五六", "🎉" * 5]
    n = stub.CountTokens(tokenizer_pb2.EncodeRequest(text=texts[1])).num_tokens
    assert n == len(local.encode(texts[1]))
    batch = stub.EncodeBatch(
        tokenizer_pb2.EncodeBatchRequest(
            requests=[tokenizer_pb2.EncodeRequest(text=t) for t in texts]
        )
    )
    assert [list(r.token_ids) for r in batch.responses] == [local.encode(t) for t in texts]
    mixed = stub.EncodeBatch(
        tokenizer_pb2.EncodeBatchRequest(
            requests=[
                tokenizer_pb2.EncodeRequest(text="a"),
                tokenizer_pb2.EncodeRequest(messages=chat(("user", "b"))),
            ]
        )
    )
    assert len(mixed.responses) == 2
    ids = local.encode("<|im_start|>hello")
    assert stub.Decode(tokenizer_pb2.DecodeRequest(token_ids=ids)).text == "hello"
    raw = stub.Decode(tokenizer_pb2.DecodeRequest(token_ids=ids, skip_special_tokens=False))
    assert raw.text == "<|im_start|>hello"


def test_decode_stream_is_utf8_safe(
    stub: tokenizer_pb2_grpc.TokenizerStub, local: TextTokenizer
) -> None:
    text = "naïve 你好 🎉🚀 done"
    ids = local.encode(text)
    reqs = [tokenizer_pb2.DecodeStreamRequest(token_ids=[i]) for i in ids]
    reqs.append(tokenizer_pb2.DecodeStreamRequest(finish=True))
    deltas = [r.text for r in stub.DecodeStream(iter(reqs))]
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


def test_tokenizer_info(stub: tokenizer_pb2_grpc.TokenizerStub) -> None:
    info = stub.GetTokenizerInfo(tokenizer_pb2.GetTokenizerInfoRequest())
    assert info.vocab_size == 49152
    assert list(info.eos_token_ids) == [2]
    assert info.has_chat_template
    assert info.max_input_chars == 20000  # from the env override in conftest


BAD_INPUTS = [
    ("Encode", tokenizer_pb2.EncodeRequest(text=""), "text is empty"),
    ("Encode", tokenizer_pb2.EncodeRequest(), "set either `text` or `messages`"),
    ("Encode", tokenizer_pb2.EncodeRequest(text="x" * 20001), "the limit is 20000"),
    ("Encode", tokenizer_pb2.EncodeRequest(messages=chat()), "messages is empty"),
    ("Encode", tokenizer_pb2.EncodeRequest(messages=chat(("robot", "hi"))), "valid roles"),
    ("Encode", tokenizer_pb2.EncodeRequest(model="gpt-9", text="hi"), "unknown model 'gpt-9'"),
    ("CountTokens", tokenizer_pb2.EncodeRequest(text=""), "text is empty"),
    ("EncodeBatch", tokenizer_pb2.EncodeBatchRequest(), "requests is empty"),
    (
        "EncodeBatch",
        tokenizer_pb2.EncodeBatchRequest(
            requests=[tokenizer_pb2.EncodeRequest(text="ok"), tokenizer_pb2.EncodeRequest(text="")]
        ),
        "texts[1] is empty",
    ),
    ("Decode", tokenizer_pb2.DecodeRequest(token_ids=[5, 49152]), "token_ids[1] = 49152"),
    ("Decode", tokenizer_pb2.DecodeRequest(token_ids=[2**32 - 1]), "outside the vocabulary"),
]


@pytest.mark.parametrize(
    ("method", "request_msg", "message"),
    BAD_INPUTS,
    ids=[f"{m}-{i}" for i, (m, _, _) in enumerate(BAD_INPUTS)],
)
def test_bad_input_is_invalid_argument(
    stub: tokenizer_pb2_grpc.TokenizerStub, method: str, request_msg: Any, message: str
) -> None:
    with pytest.raises(grpc.RpcError) as err:
        getattr(stub, method)(request_msg, timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in (err.value.details() or "")


def test_decode_stream_bad_id_is_invalid_argument(stub: tokenizer_pb2_grpc.TokenizerStub) -> None:
    reqs = iter(
        [
            tokenizer_pb2.DecodeStreamRequest(token_ids=[5]),
            tokenizer_pb2.DecodeStreamRequest(token_ids=[10**6]),
        ]
    )
    with pytest.raises(grpc.RpcError) as err:
        list(stub.DecodeStream(reqs, timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "outside the vocabulary" in (err.value.details() or "")


def test_health_reflection_and_metrics(
    channel: grpc.Channel, tokenizer_server: ManagedProcess
) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    for svc in ("", "llm.v1.Tokenizer"):
        resp = health.Check(health_pb2.HealthCheckRequest(service=svc), timeout=5)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
    refl = reflection_pb2_grpc.ServerReflectionStub(channel)
    answers = list(
        refl.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
        )
    )
    names = {s.name for s in answers[0].list_services_response.service}
    assert {"llm.v1.Tokenizer", "grpc.health.v1.Health"} <= names
    url = f"http://127.0.0.1:{tokenizer_server.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as r:
        body = r.read().decode()
    assert 'tokenizer_requests_total{code="INVALID_ARGUMENT",method="Encode"}' in body
    assert "tokenizer_request_seconds_bucket" in body


def test_sigterm_drains_and_exits_cleanly(model_dir: Path, tmp_path: Path) -> None:
    proc = ManagedProcess(
        name="tokenizer-drain",
        module="tokenizer_svc",
        args=["--port", "0", "--metrics-port", "-1", "--model-dir", str(model_dir)],
        log_dir=tmp_path,
    ).start(timeout=60)
    try:
        with grpc.insecure_channel(proc.address) as ch:
            stub = tokenizer_pb2_grpc.TokenizerStub(ch)
            assert stub.Encode(tokenizer_pb2.EncodeRequest(text="hi"), timeout=5).token_ids
        proc.signal(signal.SIGTERM)
        assert proc.proc is not None
        assert proc.proc.wait(timeout=30) == 0
        log = proc.log_path.read_text()
        assert '"shutting down"' in log
        assert '"stopped"' in log
    finally:
        proc.stop()
