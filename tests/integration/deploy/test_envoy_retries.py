"""Retries and ejection with the real config: before the first byte only, never after.

Two fake gateway replicas behind a real Envoy. Replica "a" misbehaves in a
chosen way, replica "b" answers normally; the calls each replica saw show
what Envoy retried.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from deploy.envoy import EnvoyProcess, render_config_file
from llm.v1 import gateway_pb2, gateway_pb2_grpc
from tests.integration.deploy.fake_gateway import FakeGateway, Mode

pytestmark = pytest.mark.integration


@dataclass(slots=True)
class Pair:
    a: FakeGateway
    b: FakeGateway
    envoy: EnvoyProcess
    partial: list[str] = field(default_factory=list)  # chunks before the last error

    def generate(self, n: int) -> list[str | grpc.StatusCode]:
        """``n`` Generate calls in sequence: the joined text, or the error code."""
        out: list[str | grpc.StatusCode] = []
        with grpc.insecure_channel(self.envoy.listener_address()) as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            for i in range(n):
                chunks: list[str] = []
                try:
                    for chunk in stub.Generate(
                        gateway_pb2.GenerateRequest(prompt="hi", request_id=f"r{i}"), timeout=10
                    ):
                        chunks.append(chunk.text)
                    out.append("".join(chunks))
                except grpc.RpcError as err:
                    out.append(err.code())
                    self.partial = chunks
        return out


def _pair(
    mode_a: Mode,
    workdir: Path,
    mode_b: Mode = Mode.OK,
    edit: Callable[[str], str] = lambda text: text,
) -> Iterator[Pair]:
    a = FakeGateway("a", mode_a).start()
    b = FakeGateway("b", mode_b).start()
    envoy = None
    try:
        config = render_config_file(
            workdir / "envoy.yaml",
            listener_host="127.0.0.1",
            plaintext=True,  # loopback; TLS is tested in test_tls_envoy.py
            listener_port=0,
            admin_port=0,
            gateway=[a.address, b.address],
            admin=[a.address],
            access_log_path=workdir / "access.log",
        )
        config.write_text(edit(config.read_text()))
        envoy = EnvoyProcess(config, log_dir=workdir).start()
        yield Pair(a, b, envoy)
    finally:
        if envoy is not None:
            envoy.stop()
        a.stop()
        b.stop()


@pytest.fixture
def trailers_only_unavailable(tmp_path: Path) -> Iterator[Pair]:
    yield from _pair(Mode.UNAVAILABLE_AT_ONCE, tmp_path)


@pytest.fixture
def unavailable_mid_stream(tmp_path: Path) -> Iterator[Pair]:
    yield from _pair(Mode.UNAVAILABLE_AFTER_FIRST_CHUNK, tmp_path)


def test_trailers_only_unavailable_is_retried_on_the_other_replica_then_ejected(
    trailers_only_unavailable: Pair,
) -> None:
    pair = trailers_only_unavailable
    n = 30
    results = pair.generate(n)
    # every call succeeded: whenever "a" refused before its first message,
    # Envoy retried on "b" (previous_hosts keeps it off "a")
    assert results == ["b says hi"] * n
    assert pair.b.calls == n
    # "a" was picked at least until three consecutive gateway failures ejected
    # it (a worker may route one or two more before the ejection reaches it)
    assert 3 <= pair.a.calls <= 5, pair.a.calls
    stats = pair.envoy.stats(r"^cluster\.gateway\.(upstream_rq_retry|outlier_detection\.)")
    assert stats["cluster.gateway.upstream_rq_retry"] == pair.a.calls
    ejected = "cluster.gateway.outlier_detection.ejections_enforced_consecutive_gateway_failure"
    assert stats[ejected] >= 1
    _, clusters = pair.envoy.admin_get("/clusters")
    assert f"gateway::{pair.a.address}::health_flags::/failed_outlier_check" in clusters


def test_no_retry_once_the_response_has_started(unavailable_mid_stream: Pair) -> None:
    pair = unavailable_mid_stream
    pair.b.mode = Mode.UNAVAILABLE_AFTER_FIRST_CHUNK
    n = 4
    results = pair.generate(n)
    assert results == [grpc.StatusCode.UNAVAILABLE] * n
    # one upstream call per request: the first chunk had reached the client,
    # so the failure went to the client instead of a second replica
    assert pair.a.calls + pair.b.calls == n
    assert pair.partial in (["a"], ["b"])
    stats = pair.envoy.stats(r"^cluster\.gateway\.upstream_rq_retry$")
    assert stats["cluster.gateway.upstream_rq_retry"] == 0


@pytest.fixture
def slow_streams_short_request_timeout(tmp_path: Path) -> Iterator[Pair]:
    """The real config with its request_timeout cut from 60 s to 1 s, and streams of 1.6 s."""

    def shorten(text: str) -> str:
        assert "request_timeout: 60s" in text
        return text.replace("request_timeout: 60s", "request_timeout: 1s")

    yield from _pair(Mode.SLOW, tmp_path, Mode.SLOW, shorten)


def test_request_timeout_never_cuts_a_response_stream(
    slow_streams_short_request_timeout: Pair,
) -> None:
    """Envoy's request_timeout bounds receiving the request (slow uploads); it stops once
    the request is in, so a stream that outlives it is delivered whole."""
    out = slow_streams_short_request_timeout.generate(2)
    assert all(text in ("a says hi", "b says hi") for text in out), out
