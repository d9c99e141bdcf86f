"""Two models with different tokenizers behind one gateway, each tokenized with its own.

The second model is the same weights under another name with another chat
template (a tokenizer of its own: another digest), served by a real engine. The
gateway has no model directory: both tokenizers come from the engines
(Engine.GetTokenizer), and the prompt token counts each model reports are the
ones its own tokenizer gives.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from common.procs import ManagedProcess
from common.redis_server import RedisServer
from llm.v1 import engine_pb2, engine_pb2_grpc, gateway_pb2
from tests.conftest import engine_running
from tests.integration.gateway.conftest import EnginePair, GatewayProcess, chat, start_gateway
from tokenizer_svc.chat_template import Message
from tokenizer_svc.tokenizer import TextTokenizer

pytestmark = pytest.mark.integration
SECOND = "smol-terse"
TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are Terse, an assistant who answers in as few words as "
    "possible, always, whatever the question.<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def second_dir(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same weights (linked), a tokenizer_config with another chat template."""
    d = tmp_path_factory.mktemp("second-model")
    for f in model_dir.iterdir():
        if f.name not in ("tokenizer_config.json", "chat_template.jinja"):
            (d / f.name).symlink_to(f)
    cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    cfg["chat_template"] = TEMPLATE
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


@pytest.fixture(scope="module")
def second_engine(
    second_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ManagedProcess]:
    with engine_running(
        "gw-second-model",
        second_dir,
        tmp_path_factory.mktemp("gw-second-model"),
        env={"LLM_ENGINE_MODEL_NAME": SECOND},
    ) as proc:
        yield proc


@pytest.fixture(scope="module")
def two_model_gw(
    engines: EnginePair,
    second_engine: ManagedProcess,
    tokenizer_server: ManagedProcess,
    gw_redis: RedisServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[GatewayProcess]:
    engines.ensure_running()
    gw = start_gateway(
        "gateway-two-models",
        [engines.addresses[0], second_engine.address],
        tokenizer_server.address,
        gw_redis.url,
        tmp_path_factory.mktemp("gateway-two-models"),
        # no tokenizer of its own: a model whose engines served none would not route
        {"LLM_GATEWAY_MODEL_DIR": "", "LLM_MODEL_DIR": "/nonexistent"},
    )
    try:
        yield gw
    finally:
        gw.stop()


def test_each_model_is_tokenized_with_its_own_tokenizer(
    two_model_gw: GatewayProcess, model_dir: Path, second_dir: Path, second_engine: ManagedProcess
) -> None:
    gw = two_model_gw
    _, key = gw.tenant()
    md = (("authorization", f"Bearer {key}"),)
    cards = gw.stub.ListModels(gateway_pb2.ListModelsRequest(), metadata=md)
    names = {c.id for c in cards.models}
    first = next(n for n in names if n != SECOND)
    assert SECOND in names
    question = "What is the capital of France?"
    msgs = [Message("user", question)]
    counts = {}
    for name, d in ((first, model_dir), (SECOND, second_dir)):
        req = chat(question, max_tokens=4, temperature=0.0)
        req.model = name
        out = gw.generate(key, req)
        assert out[-1].usage.completion_tokens == 4
        ids, _ = TextTokenizer(d).encode_chat(msgs)
        counts[name] = out[-1].usage.prompt_tokens
        assert counts[name] == len(ids), name
    assert counts[SECOND] != counts[first]  # the templates differ, so the prompts do
    assert gw.metric("gateway_tokenizers") == 2
    # the second engine announces the digest of the files it serves
    with grpc.insecure_channel(second_engine.address) as ch:
        info = engine_pb2_grpc.EngineStub(ch).GetModelInfo(
            engine_pb2.GetModelInfoRequest(), timeout=10
        )
    assert info.tokenizer_digest == TextTokenizer(second_dir).digest
    assert info.tokenizer_digest != TextTokenizer(model_dir).digest
