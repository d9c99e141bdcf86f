"""The OpenAI-compatible API through a real Envoy (deploy/envoy/envoy.yaml, rendered).

The SDK streams over HTTP/1.1 through Envoy, curl streams over HTTP/2 (h2c,
prior knowledge) with events arriving before the end, and the admin API's
HTTP/JSON transcoding keeps working beside the new routes.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from deploy.envoy import EnvoyProcess
from tests.integration.gateway.conftest import ADMIN_KEY, HttpGateway

pytestmark = pytest.mark.integration
DESCRIPTOR = Path(__file__).resolve().parents[3] / "build" / "llm_v1.pb"


@pytest.fixture(scope="module")
def edge(
    http_gateway: HttpGateway, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EnvoyProcess]:
    if not DESCRIPTOR.exists():
        pytest.fail(f"{DESCRIPTOR} missing: run `make protos` (make test does it)")
    workdir = tmp_path_factory.mktemp("envoy-openai")
    # plaintext on loopback: TLS at the edge is test_tls_envoy.py's
    path = http_gateway.envoy_config(workdir, plaintext=True)
    with EnvoyProcess(path, log_dir=workdir) as envoy:
        yield envoy


def test_sdk_streams_chat_through_envoy(http_gateway: HttpGateway, edge: EnvoyProcess) -> None:
    _, key = http_gateway.gw.tenant()
    base = f"http://{edge.listener_address()}/v1"
    with openai.OpenAI(base_url=base, api_key=key, max_retries=0, timeout=60) as client:
        raw = client.chat.completions.with_raw_response.create(
            model="",
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_headers={"x-request-id": "via-envoy-1"},
        )
        assert raw.headers["x-request-id"] == "via-envoy-1"
        chunks = list(raw.parse())
        assert chunks[0].id == "chatcmpl-via-envoy-1"
        assert chunks[-1].usage is not None
        assert 0 < chunks[-1].usage.completion_tokens <= 8
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert [m.id for m in client.models.list().data]
        with pytest.raises(openai.AuthenticationError):
            client.with_options(api_key="sk-llm-wrong").models.list()


def test_http2_stream_through_envoy_is_not_buffered(
    http_gateway: HttpGateway, edge: EnvoyProcess
) -> None:
    tid, key = http_gateway.gw.tenant()
    body = json.dumps(
        {
            "model": "",
            "prompt": "Once upon a time",
            "max_tokens": 40,
            "stream": True,
            "ignore_eos": True,
        }
    )
    cmd = [
        "curl",
        "-sS",
        "-N",
        "--http2-prior-knowledge",
        "-i",
        "--max-time",
        "60",
        "-H",
        f"Authorization: Bearer {key}",
        "-H",
        "Content-Type: application/json",
        "-d",
        body,
        f"http://{edge.listener_address()}/v1/completions",
    ]
    leases_at_first_event: list[int] = []
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) as proc:
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:
            if line.startswith("data: ") and not leases_at_first_event:
                # the request's lease is held until its stream ends
                leases_at_first_event.append(http_gateway.gw.usage(tid).concurrent_in_use)
            lines.append(line)
        assert proc.wait(10) == 0
    assert lines[0].startswith("HTTP/2 200")
    assert any(line.lower().startswith("content-type: text/event-stream") for line in lines)
    events = [line for line in lines if line.startswith("data: ")]
    assert events[-1].strip() == "data: [DONE]"
    assert len(events) > 5
    # by the order of events: the first one reached the client while the request was
    # still being served, not after the whole completion
    assert leases_at_first_event == [1], "Envoy buffered the stream"


def test_admin_transcoding_still_works(http_gateway: HttpGateway, edge: EnvoyProcess) -> None:
    tid, _ = http_gateway.gw.tenant()
    out = subprocess.run(
        [
            "curl",
            "-sS",
            "--max-time",
            "10",
            "-H",
            f"Authorization: Bearer {ADMIN_KEY}",
            f"http://{edge.listener_address()}/v1/admin/tenants/{tid}",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(out.stdout)["id"] == tid
