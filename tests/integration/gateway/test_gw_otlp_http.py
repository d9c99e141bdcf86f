"""A real gateway (in front of the session's engine) exporting over OTLP/HTTP to a receiver
this module runs on loopback: the request span carries OpenTelemetry's GenAI attributes,
the GenAI metrics arrive with the conventions' names, units and buckets, and, with prices
configured, the tenant's spend is a Prometheus series."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from prometheus_client.parser import text_string_to_metric_families

from common.procs import ManagedProcess
from common.redis_server import RedisServer
from tests.integration.gateway.conftest import GatewayProcess, chat, start_gateway
from tests.support.otlp_http import OtlpHttpReceiver, Received

pytestmark = pytest.mark.integration

PRICE = {"prompt_per_million": 3.0, "completion_per_million": 15.0}
METRICS = (
    "gen_ai.server.request.duration",
    "gen_ai.server.time_to_first_token",
    "gen_ai.server.time_per_output_token",
    "gen_ai.client.token.usage",
)


@dataclass
class Exporting:
    receiver: OtlpHttpReceiver
    gateway: GatewayProcess


@pytest.fixture(scope="module")
def exporting(
    engine_server: ManagedProcess,
    tokenizer_server: ManagedProcess,
    gw_redis: RedisServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Exporting]:
    with OtlpHttpReceiver() as receiver:
        gw = start_gateway(
            "otlp-http-gateway",
            [engine_server.address],
            tokenizer_server.address,
            gw_redis.url,
            tmp_path_factory.mktemp("otlp-http"),
            env={
                "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
                "LLM_GATEWAY_OTLP_PROTOCOL": "http/protobuf",  # the config key
                "OTEL_SERVICE_NAME": "gw-http",
                "OTEL_BSP_SCHEDULE_DELAY": "50",
                "OTEL_METRIC_EXPORT_INTERVAL": "200",
                "LLM_GATEWAY_PRICES": json.dumps({"*": PRICE}),
            },
        )
        try:
            yield Exporting(receiver, gw)
        finally:
            gw.stop()


def test_a_chat_request_over_otlp_http(exporting: Exporting) -> None:
    gw = exporting.gateway
    tenant_id, key = gw.tenant()
    req = chat("Name a colour.", max_tokens=4, temperature=0.0, top_p=0.5)
    req.request_id = "otlp-http-1"
    chunks = gw.generate(key, req)
    model = chunks[0].model
    usage = chunks[-1].usage

    def arrived(got: Received) -> bool:
        root = [s for s in got.spans if s.name == "gateway.request"]
        return bool(root) and all(name in got.points for name in METRICS)

    got = exporting.receiver.wait(arrived)
    (root,) = [s for s in got.spans if s.attributes.get("llm.request_id") == "otlp-http-1"]
    assert root.service == "gw-http"
    attrs = root.attributes
    assert attrs["gen_ai.operation.name"] == "chat"
    assert attrs["gen_ai.request.model"] == model
    assert attrs["gen_ai.response.model"] == model
    assert attrs["gen_ai.response.id"] == "otlp-http-1"
    assert attrs["gen_ai.request.max_tokens"] == 4
    assert attrs["gen_ai.request.top_p"] == 0.5
    assert attrs["gen_ai.usage.input_tokens"] == usage.prompt_tokens
    assert attrs["gen_ai.usage.output_tokens"] == usage.completion_tokens

    (duration,) = got.points["gen_ai.server.request.duration"]
    assert duration.unit == "s"
    assert duration.attributes["gen_ai.operation.name"] == "chat"
    assert duration.attributes["gen_ai.request.model"] == model
    assert duration.count >= 1
    (ttft,) = got.points["gen_ai.server.time_to_first_token"]
    assert ttft.bounds[0] == 0.001
    tokens = {
        p.attributes["gen_ai.token.type"]: p.sum for p in got.points["gen_ai.client.token.usage"]
    }
    assert tokens == {"input": usage.prompt_tokens, "output": usage.completion_tokens}

    spent = scrape_spend(gw, tenant_id, model)
    expected = (usage.prompt_tokens * 3.0 + usage.completion_tokens * 15.0) / 1e6
    assert spent == pytest.approx(expected)


def scrape_spend(gw: GatewayProcess, tenant: str, model: str) -> float:
    url = f"http://127.0.0.1:{gw.proc.metrics_port}/metrics"
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(url, timeout=10) as r:
        text = r.read().decode()
    (value,) = [
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "gateway_tenant_spend_usd_total"
        and s.labels == {"tenant": tenant, "model": model}
    ]
    return float(value)
