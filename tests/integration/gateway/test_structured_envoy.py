"""Structured outputs and tool calling through a real Envoy (deploy/envoy/envoy.yaml,
rendered) with the official openai client, on the default model: ``parse`` with a
Pydantic model and a required tool call, streamed and not; every output parses."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from deploy.envoy import EnvoyProcess
from tests.integration.gateway.conftest import HttpGateway
from tests.integration.gateway.test_openai_envoy import DESCRIPTOR
from tests.integration.gateway.test_structured_outputs import ASK as CITY
from tests.integration.gateway.test_structured_outputs import City
from tests.integration.gateway.test_tools_calling import ASK as WEATHER
from tests.integration.gateway.test_tools_calling import TOOLS, GetTime, GetWeather

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def client(
    http_gateway: HttpGateway, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[openai.OpenAI]:
    if not DESCRIPTOR.exists():
        pytest.fail(f"{DESCRIPTOR} missing: run `make protos` (make test does it)")
    workdir = tmp_path_factory.mktemp("envoy-structured")
    _, key = http_gateway.gw.tenant()
    with EnvoyProcess(http_gateway.envoy_config(workdir, plaintext=True), log_dir=workdir) as edge:
        base = f"http://{edge.listener_address()}/v1"
        with openai.OpenAI(base_url=base, api_key=key, max_retries=0, timeout=60) as c:
            yield c


def test_parse_and_tools_through_envoy(client: openai.OpenAI) -> None:
    # the requests of test_structured_outputs / test_tools_calling, this time through Envoy
    done = client.chat.completions.parse(
        model="", messages=CITY, response_format=City, max_tokens=64, temperature=0, seed=7
    )
    assert isinstance(done.choices[0].message.parsed, City)
    with client.chat.completions.stream(
        model="", messages=CITY, response_format=City, max_tokens=64, temperature=0.7, seed=3
    ) as stream:
        for _ in stream:
            pass
        assert isinstance(stream.get_final_completion().choices[0].message.parsed, City)
    called = client.chat.completions.parse(
        model="",
        messages=WEATHER,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "GetWeather"}},
        max_tokens=48,
        temperature=0.8,
        seed=1,
    )
    (call,) = called.choices[0].message.tool_calls or []
    assert isinstance(call.function.parsed_arguments, GetWeather)
    with client.chat.completions.stream(
        model="",
        messages=WEATHER,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=64,
        temperature=0.8,
        seed=2,
    ) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls"
    (call,) = final.message.tool_calls or []
    assert isinstance(call.function.parsed_arguments, GetWeather | GetTime)
