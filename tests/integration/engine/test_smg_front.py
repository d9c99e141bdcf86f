"""SMG (the `smg` 1.13 wheel, a stock gateway for the standard engine protocols) in
front of our engine over gRPC: a streamed chat completion and a cancel through SMG's
OpenAI HTTP API. SMG tokenizes with the test model's files, speaks VllmEngine to the
engine, and the engine's own stats show the cancelled request's KV blocks freed.

Why the engine port here is plaintext without a service token, for SMG only: SMG 1.13
cannot authenticate to a gRPC worker in any way our engine can check. Its gRPC worker
channel is plaintext even for a ``grpcs://`` URL (it sends cleartext HTTP/2 to a TLS
port: the server's handshake fails with HTTP_REQUEST) and carries no credential
metadata (``--api-key`` is not sent; only ``user-agent``), so neither mutual TLS nor
the service token can admit it. ``test_smg_cannot_reach_a_tls_worker`` checks that
limit against a real mutual-TLS port and fails once SMG learns TLS for gRPC workers:
then this test moves to the engine's mutual-TLS port (``mtls_args``). In a deployment
SMG in front of our engine needs a network boundary instead (the NetworkPolicy that
admits only the gateway's pods), as for a stock vLLM worker behind SMG."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

import grpc
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2, vllm_engine_pb2_grpc

from bench.gatewaylib.smg import SmgProcess, SmgTenant
from common.config import ROOT
from common.pgroup import LoggedChild
from common.procs import ManagedProcess
from common.server import bind
from common.service_auth import read_server_tls
from llm.v1 import engine_pb2, engine_pb2_grpc
from tests.integration.engine.conftest import wait_for_idle
from tests.integration.engine.test_standard_auth import (
    Pki,
    make_pki,
    mtls_credentials,
)

# an engine start measures its kernels first: minutes on a loaded machine
pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

SMG = ROOT / ".venv" / "bin" / "smg"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def engine(engine_server: ManagedProcess) -> ManagedProcess:
    """The session's engine (plaintext, no service token: see the module docstring)."""
    return engine_server


def get_json(url: str, timeout: float = 5) -> object:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


@contextlib.contextmanager
def smg_running(
    worker_url: str, model_dir: Path, log_dir: Path, extra: Sequence[str] = (), wait: float = 180
) -> Iterator[tuple[str, LoggedChild]]:
    """SMG on free ports in front of ``worker_url``: its base URL and process once a
    model is listed (``wait`` = 0: at once); always stopped."""
    if not SMG.exists():
        pytest.fail(f"{SMG} is missing: the smg wheel is a test dependency (make setup)")
    port = free_port()
    child = LoggedChild()
    child.name, child.log_path = "smg", log_dir / "smg.log"
    cmd = [
        str(SMG), "launch", "--host", "127.0.0.1", "--port", str(port),
        "--worker-urls", worker_url, "--model-path", str(model_dir), *extra,
        "--prometheus-port", str(free_port()), "--prometheus-host", "127.0.0.1",
        "--policy", "round_robin", "--log-level", "info",
    ]  # fmt: skip
    child.spawn(cmd, cwd=ROOT, env={**os.environ})
    base = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        # the worker is listed first; its tokenizer loads after it (a chat gets 503 until
        # then), so ready is a one-token chat completion answered
        try:
            models = get_json(f"{base}/v1/models")
            if not (isinstance(models, dict) and models.get("data")):
                return False
            req = chat(base, str(models["data"][0]["id"]), 1, stream=False)
            with urllib.request.urlopen(req, timeout=60) as resp:
                return bool(resp.status == 200)
        except (OSError, urllib.error.URLError, ValueError):
            return False

    try:
        if wait:
            child.wait_ready(ready, wait, poll_s=0.5)
        yield base, child
    finally:
        child.stop()


@pytest.fixture(scope="module")
def smg(
    engine: ManagedProcess, model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    logs = tmp_path_factory.mktemp("smg-logs")
    with smg_running(f"grpc://127.0.0.1:{engine.port}", model_dir, logs) as (base, _):
        yield base


@pytest.fixture(scope="module")
def stats(engine: ManagedProcess) -> Iterator[engine_pb2_grpc.EngineStub]:
    with grpc.insecure_channel(engine.address) as ch:
        yield engine_pb2_grpc.EngineStub(ch)


def chat(base: str, model: str, max_tokens: int, **extra: object) -> urllib.request.Request:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Write a long story about a lighthouse."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        **extra,
    }
    return urllib.request.Request(
        f"{base}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )


def sse_events(resp: object) -> Iterator[dict[str, object]]:
    for raw in resp:  # type: ignore[attr-defined]
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


def served_model(base: str) -> str:
    models = get_json(f"{base}/v1/models")
    assert isinstance(models, dict)
    return str(models["data"][0]["id"])


def test_smg_streams_a_chat_completion_from_our_engine(
    smg: str, stats: engine_pb2_grpc.EngineStub
) -> None:
    before = stats.GetStats(engine_pb2.GetStatsRequest()).num_requests_total
    with urllib.request.urlopen(chat(smg, served_model(smg), 24), timeout=120) as resp:
        assert resp.status == 200
        events = list(sse_events(resp))
    text = "".join(
        str(c["delta"].get("content") or "")  # type: ignore[index,union-attr]
        for e in events
        for c in e.get("choices", [])  # type: ignore[attr-defined]
    )
    finish = [
        c.get("finish_reason")  # type: ignore[union-attr]
        for e in events
        for c in e.get("choices", [])  # type: ignore[attr-defined]
        if c.get("finish_reason")  # type: ignore[union-attr]
    ]
    assert text.strip(), events
    assert finish in (["length"], ["stop"]), events
    # the tokens came from our engine: its own counter moved
    assert stats.GetStats(engine_pb2.GetStatsRequest()).num_requests_total > before


def test_a_client_cancel_through_smg_frees_the_engines_kv_blocks(
    smg: str, stats: engine_pb2_grpc.EngineStub
) -> None:
    before = wait_for_idle(stats)
    resp = urllib.request.urlopen(chat(smg, served_model(smg), 1500, ignore_eos=True), timeout=120)
    try:
        for seen, _ in enumerate(sse_events(resp), 1):
            if seen == 4:
                busy = stats.GetStats(engine_pb2.GetStatsRequest())
                assert busy.num_running == 1
                assert busy.num_kv_blocks_used > before
                break
    finally:
        resp.close()  # the client goes away mid-stream
    assert wait_for_idle(stats) == before
    after = stats.GetStats(engine_pb2.GetStatsRequest())
    assert (after.num_running, after.num_waiting) == (0, 0)


class _Health(vllm_engine_pb2_grpc.VllmEngineServicer):  # type: ignore[misc]
    def __init__(self) -> None:
        self.calls = 0

    def HealthCheck(self, request: object, context: object) -> object:
        self.calls += 1
        return vllm_engine_pb2.HealthCheckResponse(healthy=True, message="ok")


def test_smg_cannot_reach_a_tls_worker(pki: Pki, model_dir: Path, tmp_path: Path) -> None:
    """SMG 1.13 with a client certificate and our CA against a mutual-TLS gRPC port
    bound the engine's way (``common.server.bind``, a VllmEngine health servicer, no
    model): its worker probe never completes a handshake, so no call arrives."""
    tls = read_server_tls(str(pki.tls.cert), str(pki.tls.key), str(pki.tls.ca_cert))
    assert tls is not None
    servicer = _Health()

    async def serve(stop: asyncio.Event) -> None:
        server = grpc.aio.server()
        vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(servicer, server)
        port = bind(server, "127.0.0.1:0", tls)
        bound.append(port)
        await server.start()
        await stop.wait()
        await server.stop(0)

    bound: list[int] = []
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    thread = threading.Thread(target=loop.run_until_complete, args=(serve(stop),))
    thread.start()
    try:
        while not bound:
            time.sleep(0.05)
        # the same port admits a client with the CA's certificate (so the port is sound)
        creds = mtls_credentials(pki, pki.client_cert, pki.client_key)
        with grpc.secure_channel(f"localhost:{bound[0]}", creds) as ch:
            stub = vllm_engine_pb2_grpc.VllmEngineStub(ch)
            assert stub.HealthCheck(vllm_engine_pb2.HealthCheckRequest(), timeout=10).healthy
        assert servicer.calls == 1
        extra = [
            "--client-cert-path", str(pki.client_cert), "--client-key-path", str(pki.client_key),
            "--ca-cert-paths", str(pki.tls.ca_cert),
        ]  # fmt: skip
        url = f"grpcs://localhost:{bound[0]}"
        with smg_running(url, model_dir, tmp_path, extra, wait=0) as (_, child):
            deadline = time.monotonic() + 60
            while "detect_connection_mode" not in child.log_path.read_text(errors="replace"):
                assert time.monotonic() < deadline, "SMG never probed the worker"
                time.sleep(0.5)
            time.sleep(3)  # its first probe has failed by now; the next is 30 s later
            log = child.log_path.read_text(errors="replace")
        assert "transport error" in log, log[-3000:]
        assert servicer.calls == 1, "SMG reached a TLS worker: move test_smg_* to mutual TLS"
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join()
        loop.close()


def test_smg_with_a_tenant_takes_only_its_key_and_keeps_its_request_budget(
    engine: ManagedProcess, model_dir: Path, tmp_path: Path
) -> None:
    """The bench's ``smg-tenant`` side (``bench.gatewaylib.smg.SmgTenant``): SMG refuses
    a request without the tenant's key or with another, serves the tenant's own, and
    denies the tenant's request past its per-minute budget: the work the gateway's
    authentication and limits do, done by SMG, so the bench compares like with like."""
    tenant = SmgTenant(tokens_per_minute=1_000_000, requests_per_minute=2)
    with SmgProcess(
        [f"grpc://127.0.0.1:{engine.port}"], model_dir, tmp_path, name="smg-t", tenant=tenant
    ) as proc:
        model = served_model(proc.url)

        def status(key: str | None) -> int:
            req = chat(proc.url, model, 2)
            if key is not None:
                req.add_header("Authorization", f"Bearer {key}")
            try:
                with urllib.request.urlopen(req, timeout=120) as resp:
                    assert list(sse_events(resp)), "a stream with no events"
                    return int(resp.status)
            except urllib.error.HTTPError as e:
                return int(e.code)

        assert status(None) == 401
        assert status("sk-not-the-tenants") == 401
        assert [status(tenant.key) for _ in range(3)] == [200, 200, 429]
