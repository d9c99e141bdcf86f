"""``--spawn``: the real services a run needs, on ephemeral ports, stopped by pid.

    engine replica(s)  python -m engine_svc  (real model; pool and batch limits from
                       BENCH_ENGINE_ENV, overridable per run)
    tokenizer          python -m tokenizer_svc              (gateway targets)
    Redis              common.redis_server.RedisServer        (gateway targets)
    gateway            python -m gateway, with a fresh admin key
    Envoy              deploy.envoy.EnvoyProcess on a rendered config (envoy target)

The engine module may be a stand-in with the engine's server (bench.gatewaylib's stub),
the engines and the proxies (the gateway with its workers, any relay added with
``Stack.service``) may run on CPUs of their own, and ``tenant_key`` / ``setup_tenants``
create tenants and their API keys through the admin API. Everything is stopped in
reverse start order, each by its own pid, even when start-up fails half-way.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import grpc

from bench.loadlib.workload import TenantSpec
from common.procs import ManagedProcess
from llm.v1 import admin_pb2, admin_pb2_grpc, common_pb2

BENCH_ENGINE_ENV = {
    "LLM_ENGINE_CORE_DEVICE": "cpu",
    "LLM_ENGINE_CORE_NUM_KV_BLOCKS": "512",  # 8192 tokens: long contexts feel KV pressure
    "LLM_ENGINE_CORE_SCHEDULER_MAX_NUM_SEQS": "16",
    "LLM_ENGINE_CORE_SCHEDULER_MAX_NUM_BATCHED_TOKENS": "512",
    "LLM_ENGINE_CORE_MAX_MODEL_LEN": "2048",
    "LLM_ENGINE_GRACE_SECONDS": "2",
}
GATEWAY_ENV = {"LLM_GATEWAY_STATS_INTERVAL_S": "0.2", "LLM_GATEWAY_GRACE_SECONDS": "2"}


class _Stoppable(Protocol):
    def stop(self) -> object: ...


@dataclass(slots=True)
class StackSpec:
    """What to start. ``engine_env`` and ``gateway_env`` replace the defaults (the load
    bench's pool and batch limits, a fast stats poll); ``http_port`` is the gateway's
    HTTP front (-1: none); ``engine_cpus`` runs the engines on those CPUs alone, one
    torch thread each, and ``proxy_cpus`` the gateway (its workers inherit them) and
    any ``Stack.service`` started with ``proxy=True``; the rest keep the caller's.
    ``gateway_model_dir`` gives the gateway the model's tokenizer of its own (as ``make
    run`` does); off, it uses the one the engine serves."""

    model_dir: Path
    work_dir: Path
    num_engines: int = 1
    gateway: bool = False
    envoy: bool = False
    engine_env: dict[str, str] = field(default_factory=lambda: dict(BENCH_ENGINE_ENV))
    gateway_env: dict[str, str] = field(default_factory=lambda: dict(GATEWAY_ENV))
    engine_module: str = "engine_svc"
    engine_args: list[str] = field(default_factory=list)
    gateway_args: list[str] = field(default_factory=list)
    http_port: int = -1
    engine_cpus: set[int] | None = None
    proxy_cpus: set[int] | None = None
    gateway_model_dir: bool = True


@contextlib.contextmanager
def on_cpus(cpus: set[int] | None) -> Iterator[None]:
    """Run the block (and whatever it spawns: children inherit it) on ``cpus``; None =
    leave the affinity alone."""
    if cpus is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


class Stack:
    """Started services and their addresses; a context manager that stops them."""

    def __init__(self, spec: StackSpec) -> None:
        self.spec = spec
        self.admin_key = "sk-llm-" + secrets.token_urlsafe(24)
        self.engines: list[str] = []
        self.tokenizer = ""
        self.gateway = ""
        self.envoy = ""
        self.http = ""  # the gateway's HTTP front, http://host:port, when it has one
        self.procs: dict[str, ManagedProcess] = {}  # by name: bench-gateway, ...
        self._started: list[_Stoppable] = []

    @classmethod
    def alone(cls, work_dir: Path) -> Stack:
        """An unstarted stack for services started one by one with ``service`` (a
        bench of one service), logging to ``work_dir``; ``stop`` stops them."""
        return cls(StackSpec(work_dir, work_dir, num_engines=0))

    def service(
        self,
        name: str,
        module: str,
        args: list[str],
        env: dict[str, str] | None = None,
        timeout: float = 60,
        proxy: bool = False,
    ) -> ManagedProcess:
        """Start ``python -m module`` on free ports (``proxy``: on the spec's
        ``proxy_cpus``); it is stopped with the stack."""
        proc = ManagedProcess(
            name=name,
            module=module,
            env=env or {},
            log_dir=self.spec.work_dir,
            args=["--port", "0", "--metrics-port", "0", "--log-format", "json", *args],
        )
        self._started.append(proc)
        self.procs[name] = proc
        with on_cpus(self.spec.proxy_cpus if proxy else None):
            return proc.start(timeout=timeout)

    def metrics_url(self, name: str) -> str:
        """The /metrics page of the service started as ``name``."""
        return f"http://127.0.0.1:{self.procs[name].metrics_port}/metrics"

    def start(self) -> Stack:
        """Start everything the spec asks for; on failure stop what started, then raise."""
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        spec, md = self.spec, ["--model-dir", str(self.spec.model_dir)]
        env = dict(spec.engine_env)
        if spec.engine_cpus:
            env["LLM_ENGINE_CORE_NUM_THREADS"] = str(len(spec.engine_cpus))
        with on_cpus(spec.engine_cpus):
            for i in range(spec.num_engines):
                args = [*md, *spec.engine_args]
                engine = self.service(f"bench-engine-{i}", spec.engine_module, args, env, 300)
                self.engines.append(engine.address)
        if not spec.gateway and not spec.envoy:
            return
        self.tokenizer = self.service("bench-tokenizer", "tokenizer_svc", md, {}, 90).address
        from common.redis_server import RedisServer

        redis = RedisServer().start()
        self._started.append(redis)
        gw_env = {**spec.gateway_env, "ADMIN_KEY": self.admin_key}
        gw_args = ["--engines", ",".join(self.engines), "--tokenizer", self.tokenizer]
        gw_args += ["--redis-url", redis.url, "--http-port", str(spec.http_port)]
        gw_args += md if spec.gateway_model_dir else []
        gw_args += spec.gateway_args
        gateway = self.service("bench-gateway", "gateway", gw_args, gw_env, 120, proxy=True)
        self.gateway = gateway.address
        if spec.http_port > 0:
            self.http = f"http://127.0.0.1:{spec.http_port}"
        if spec.envoy:
            from deploy.envoy import EnvoyProcess, render_config_file

            cfg = render_config_file(
                spec.work_dir / "envoy.yaml",
                listener_host="127.0.0.1",
                plaintext=True,  # loopback: measures the stack, not TLS
                listener_port=0,
                admin_port=0,
                gateway=[self.gateway],
                admin=[self.gateway],
                access_log_path=spec.work_dir / "envoy-access.log",
            )
            envoy = EnvoyProcess(cfg, log_dir=spec.work_dir)
            self._started.append(envoy)
            self.envoy = envoy.start(timeout=60).listener_address()

    def stop(self) -> None:
        """Stop every started service, last started first, each by pid."""
        while self._started:
            started = self._started.pop()
            getattr(started, "close", started.stop)()  # RedisServer.close also removes its dir

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def admin_client(
    address: str, ca_cert: bytes | None = None
) -> Iterator[admin_pb2_grpc.RateLimitAdminStub]:
    """The admin API at ``address``: over TLS trusting ``ca_cert`` (Envoy), else plaintext."""
    channel = (
        grpc.secure_channel(address, grpc.ssl_channel_credentials(ca_cert))
        if ca_cert
        else grpc.insecure_channel(address)
    )
    with channel:
        yield admin_pb2_grpc.RateLimitAdminStub(channel)


def tenant_key(
    admin: admin_pb2_grpc.RateLimitAdminStub,
    admin_key: str,
    tenant: admin_pb2.Tenant,
    key_name: str = "bench",
) -> str:
    """Upsert ``tenant`` (its limits, priority, name) and return a fresh API key of it."""
    md = (("authorization", f"Bearer {admin_key}"),)
    admin.UpsertTenant(tenant, metadata=md, timeout=10)
    req = admin_pb2.CreateApiKeyRequest(tenant_id=tenant.id, name=key_name)
    return str(admin.CreateApiKey(req, metadata=md, timeout=10).key)


def setup_tenants(
    admin_address: str,
    admin_key: str,
    tenants: list[TenantSpec],
    run_tag: str = "",
    ca_cert: bytes | None = None,
) -> None:
    """Upsert each tenant (priority, limits) and give it a fresh key (``tenant.key``).

    Tenant ids get ``run_tag`` appended so repeated runs on one Redis start
    from full buckets. ``ca_cert``: over TLS trusting that CA (Envoy), else plaintext.
    """
    with admin_client(admin_address, ca_cert) as admin:
        for t in tenants:
            limits = admin_pb2.LimitPolicy(
                requests_per_minute=t.rpm,
                tokens_per_minute=t.tpm,
                max_concurrent=t.max_concurrent,
                request_burst=t.request_burst,
            )
            tenant = admin_pb2.Tenant(
                id=t.name + run_tag,
                limits=limits,
                display_name=f"load test {t.name}",
                priority=common_pb2.Priority.ValueType(t.priority_value),
            )
            t.key = tenant_key(admin, admin_key, tenant, "bench-load")
