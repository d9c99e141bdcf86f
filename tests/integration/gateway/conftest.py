"""Real services for the gateway suite: Redis, tokenizer, two engine replicas, gateways.

The two engine replicas (real model, fp32) are shared by every gateway test
module; fault tests kill one and restart it on the same port. Each gateway
runs as ``python -m gateway`` on ephemeral ports (``GatewayProcess``).
"""

from __future__ import annotations

import secrets
import socket
import threading
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import grpc
import openai
import pytest

from common.procs import ManagedProcess
from common.redis_server import RedisServer
from deploy.envoy import EnvoyProcess, render_config_file
from llm.v1 import admin_pb2, admin_pb2_grpc, common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.conftest import start_engine
from tokenizer_svc.tokenizer import TextTokenizer

ADMIN_KEY = "sk-llm-" + secrets.token_urlsafe(32)
TEST_ENV = {
    "ADMIN_KEY": ADMIN_KEY,
    "LLM_GATEWAY_DEFAULT_MAX_TOKENS": "16",
    "LLM_GATEWAY_MAX_MAX_TOKENS": "64",
    "LLM_GATEWAY_GRACE_SECONDS": "5",
    "LLM_GATEWAY_STATS_INTERVAL_S": "0.2",
    "LLM_RATELIMIT_CONCURRENCY_RETRY_MS": "500",
    "LLM_GATEWAY_HTTP_PORT": "0",  # the OpenAI front on an ephemeral port, never 8000
    "LLM_GATEWAY_AUTH_FAILURE_BURST": "60",  # the suite's own bad keys all come from 127.0.0.1
    # the suite's clients stand where Envoy would: their x-forwarded-for names the client
    "LLM_GATEWAY_TRUSTED_PROXIES": "127.0.0.1",
    # cost budgets: 1 milli-USD per prompt token, 2 per completion token, every model
    "LLM_GATEWAY_PRICES": '{"*": {"prompt_per_million": 1000, "completion_per_million": 2000}}',
}


class EnginePair:
    """Two engine replicas; ``kill``/``restart`` one on its own port."""

    def __init__(self, model_dir: Path, log_dir: Path) -> None:
        self.model_dir = model_dir
        self.log_dir = log_dir
        self.procs = [start_engine(f"gw-engine-{i}", model_dir, log_dir) for i in range(2)]

    @property
    def addresses(self) -> list[str]:
        return [p.address for p in self.procs]

    def restart(self, i: int) -> ManagedProcess:
        old = self.procs[i]
        old.stop()
        self.procs[i] = start_engine(
            f"gw-engine-{i}", self.model_dir, self.log_dir, args=["--port", str(old.port)]
        )
        return self.procs[i]

    def ensure_running(self) -> None:
        for i, p in enumerate(self.procs):
            if p.proc is None or p.proc.poll() is not None:
                self.restart(i)

    def stop(self) -> None:
        for p in self.procs:
            p.stop()


@dataclass
class GatewayProcess:
    """A gateway subprocess with stubs and helpers for tests."""

    proc: ManagedProcess
    channel: grpc.Channel = field(init=False)
    stub: gateway_pb2_grpc.GatewayStub = field(init=False)
    admin: admin_pb2_grpc.RateLimitAdminStub = field(init=False)

    def __post_init__(self) -> None:
        self.channel = grpc.insecure_channel(self.proc.address)
        self.stub = gateway_pb2_grpc.GatewayStub(self.channel)
        self.admin = admin_pb2_grpc.RateLimitAdminStub(self.channel)

    @property
    def admin_md(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {ADMIN_KEY}"),)

    def tenant(self, tenant_id: str | None = None, **limits: int) -> tuple[str, str]:
        """Create a tenant with ``limits``; returns (tenant_id, plaintext key)."""
        tid = tenant_id or f"t-{secrets.token_hex(4)}"
        self.admin.UpsertTenant(
            admin_pb2.Tenant(id=tid, limits=admin_pb2.LimitPolicy(**limits)), metadata=self.admin_md
        )
        key = self.admin.CreateApiKey(
            admin_pb2.CreateApiKeyRequest(tenant_id=tid, name="test"), metadata=self.admin_md
        ).key
        return tid, key

    def usage(self, tenant_id: str) -> admin_pb2.TenantUsage:
        return self.admin.GetUsage(
            admin_pb2.GetUsageRequest(tenant_id=tenant_id), metadata=self.admin_md
        )

    def generate(
        self,
        key: str,
        req: gateway_pb2.GenerateRequest,
        timeout: float = 60,
        metadata: tuple[tuple[str, str], ...] = (),
    ) -> list[gateway_pb2.GenerateResponse]:
        md = (("authorization", f"Bearer {key}"), *metadata)
        return list(self.stub.Generate(req, metadata=md, timeout=timeout))

    def metrics(self) -> str:
        url = f"http://127.0.0.1:{self.proc.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as resp:
            return str(resp.read().decode())

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of ``name`` whose labels include ``labels``."""
        total = 0.0
        for line in self.metrics().splitlines():
            if not line.startswith(name + "{") and not line.startswith(name + " "):
                continue
            head, value = line.rsplit(" ", 1)
            if all(f'{k}="{v}"' in head for k, v in labels.items()):
                total += float(value)
        return total

    def stop(self) -> None:
        self.channel.close()
        self.proc.stop()


def trailers(err: grpc.RpcError) -> dict[str, str]:
    """Trailing metadata of a failed call as a dict (text values)."""
    out: dict[str, str] = {}
    md = cast(Sequence[tuple[str, str | bytes]], err.trailing_metadata() or ())  # type: ignore[attr-defined]
    for key, value in md:
        out[key] = value.decode(errors="replace") if isinstance(value, bytes) else value
    return out


def chat(text: str, max_tokens: int = 8, **sampling: Any) -> gateway_pb2.GenerateRequest:
    msgs = common_pb2.ChatMessages(messages=[common_pb2.ChatMessage(role="user", content=text)])
    return gateway_pb2.GenerateRequest(
        messages=msgs, sampling=common_pb2.SamplingParams(max_tokens=max_tokens, **sampling)
    )


def start_gateway(
    name: str,
    engines: list[str],
    tokenizer: str,
    redis_url: str,
    log_dir: Path,
    env: dict[str, str] | None = None,
) -> GatewayProcess:
    proc = ManagedProcess(
        name=name,
        module="gateway",
        args=[
            "--port",
            "0",
            "--metrics-port",
            "0",
            "--engines",
            ",".join(engines),
            "--tokenizer",
            tokenizer,
            "--redis-url",
            redis_url,
            "--log-format",
            "json",
        ],
        env={**TEST_ENV, **(env or {})},
        log_dir=log_dir,
    )
    proc.start(timeout=90)
    return GatewayProcess(proc)


def envoy_over(gateways: list[GatewayProcess], logs: Path) -> EnvoyProcess:
    """A started Envoy (plaintext on loopback) in front of ``gateways`` (gRPC and admin)."""
    addrs = [g.proc.address for g in gateways]
    cfg = render_config_file(
        logs / "envoy.yaml",
        listener_host="127.0.0.1",
        plaintext=True,  # loopback; TLS is tested in test_tls_envoy.py
        listener_port=0,
        admin_port=0,
        gateway=addrs,
        admin=addrs,
        access_log_path=logs / "access.log",
    )
    envoy = EnvoyProcess(cfg, log_dir=logs)
    envoy.start(timeout=60)
    return envoy


@pytest.fixture(scope="session")
def gw_redis() -> Iterator[RedisServer]:
    server = RedisServer().start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="session")
def engines(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EnginePair]:
    pair = EnginePair(model_dir, tmp_path_factory.mktemp("gw-engines"))
    try:
        yield pair
    finally:
        pair.stop()


@pytest.fixture(scope="session")
def gateway(
    engines: EnginePair,
    tokenizer_server: ManagedProcess,
    gw_redis: RedisServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[GatewayProcess]:
    gw = start_gateway(
        "gateway",
        engines.addresses,
        tokenizer_server.address,
        gw_redis.url,
        tmp_path_factory.mktemp("gateway"),
    )
    try:
        yield gw
    finally:
        gw.stop()


@pytest.fixture(scope="session")
def tok(model_dir: Path) -> TextTokenizer:
    return TextTokenizer(model_dir)


def free_port() -> int:
    """A port that was free a moment ago (for servers that cannot report theirs)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class HttpGateway:
    """A gateway whose OpenAI-compatible HTTP front listens on a known port."""

    gw: GatewayProcess
    http_port: int

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/v1"

    def envoy_config(self, workdir: Path, **overrides: Any) -> Path:
        """deploy/envoy/envoy.yaml rendered in ``workdir`` for this gateway (its gRPC port
        for the gateway and admin clusters, its HTTP port for the OpenAI routes), every
        Envoy port ephemeral on 127.0.0.1; ``overrides``: TLS files or plaintext=True."""
        grpc_addr = self.gw.proc.address
        return render_config_file(
            workdir / "envoy.yaml",
            **{
                "listener_host": "127.0.0.1",
                "listener_port": 0,
                "admin_port": 0,
                "gateway": [grpc_addr],
                "admin": [grpc_addr],
                "gateway_http": [f"127.0.0.1:{self.http_port}"],
                "access_log_path": workdir / "access.log",
                **overrides,
            },
        )


def start_http_gateway(
    name: str,
    engines: list[str],
    tokenizer: str,
    redis_url: str,
    log_dir: Path,
    env: dict[str, str] | None = None,
) -> HttpGateway:
    port = free_port()
    gw = start_gateway(
        name,
        engines,
        tokenizer,
        redis_url,
        log_dir,
        env={"LLM_GATEWAY_HTTP_PORT": str(port), **(env or {})},
    )
    return HttpGateway(gw, port)


@pytest.fixture(scope="session")
def http_gateway(
    engines: EnginePair,
    tokenizer_server: ManagedProcess,
    gw_redis: RedisServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[HttpGateway]:
    """A gateway with its OpenAI-compatible front (tests/integration/gateway/test_openai_*)."""
    hg = start_http_gateway(
        "gateway-http",
        engines.addresses,
        tokenizer_server.address,
        gw_redis.url,
        tmp_path_factory.mktemp("gateway-http"),
    )
    try:
        yield hg
    finally:
        hg.gw.stop()


@pytest.fixture(scope="module")
def client(http_gateway: HttpGateway) -> Iterator[openai.OpenAI]:
    """The official openai client on the HTTP front, with a new tenant's key per module."""
    _, key = http_gateway.gw.tenant()
    with openai.OpenAI(base_url=http_gateway.base_url, api_key=key, max_retries=0, timeout=60) as c:
        yield c


def cancel_after_first_chunk(gw: GatewayProcess, key: str, n: int) -> None:
    """Start ``n`` long streams at once, wait until each has its first chunk, then cancel
    them all (a flood of cancels mid-stream)."""
    req = chat("Write a very long essay about the sea.", max_tokens=64)
    req.sampling.ignore_eos = True
    md = (("authorization", f"Bearer {key}"),)
    calls: list[Any] = [gw.stub.Generate(req, metadata=md, timeout=120) for _ in range(n)]
    started = threading.Barrier(n + 1, timeout=120)

    def read_one(call: Any) -> None:
        try:
            next(iter(call))
        finally:
            started.wait()

    threads = [threading.Thread(target=read_one, args=(c,)) for c in calls]
    for t in threads:
        t.start()
    started.wait()
    for c in calls:
        c.cancel()
    for t in threads:
        t.join(30)
