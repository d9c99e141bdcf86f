"""``--spawn``: the real services a run needs, on ephemeral ports, stopped by pid.

    engine replica(s)  python -m engine_svc  (real model; pool and batch limits from
                       BENCH_ENGINE_ENV, overridable per run)
    tokenizer          python -m tokenizer_svc              (gateway targets)
    Redis              common.redis_server.RedisServer        (gateway targets)
    gateway            python -m gateway, with a fresh admin key
    Envoy              deploy.envoy.EnvoyProcess on a rendered config (envoy target)

Everything is stopped in reverse start order, each by its own pid, even when
start-up fails half-way.
"""

from __future__ import annotations

import secrets
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
    "LLM_ENGINE_CORE_MAX_NUM_SEQS": "16",
    "LLM_ENGINE_CORE_MAX_NUM_BATCHED_TOKENS": "512",
    "LLM_ENGINE_CORE_MAX_MODEL_LEN": "2048",
    "LLM_ENGINE_GRACE_SECONDS": "2",
}
GATEWAY_ENV = {"LLM_GATEWAY_STATS_INTERVAL_S": "0.2", "LLM_GATEWAY_GRACE_SECONDS": "2"}


class _Stoppable(Protocol):
    def stop(self) -> object: ...


@dataclass(slots=True)
class StackSpec:
    """What to start."""

    model_dir: Path
    work_dir: Path
    num_engines: int = 1
    gateway: bool = False
    envoy: bool = False
    engine_env: dict[str, str] = field(default_factory=dict)
    gateway_env: dict[str, str] = field(default_factory=dict)


class Stack:
    """Started services and their addresses; a context manager that stops them."""

    def __init__(self, spec: StackSpec) -> None:
        self.spec = spec
        self.admin_key = "sk-llm-" + secrets.token_urlsafe(24)
        self.engines: list[str] = []
        self.tokenizer = ""
        self.gateway = ""
        self.envoy = ""
        self._started: list[_Stoppable] = []

    def _proc(
        self, name: str, module: str, args: list[str], env: dict[str, str], timeout: float
    ) -> ManagedProcess:
        proc = ManagedProcess(
            name=name,
            module=module,
            env=env,
            log_dir=self.spec.work_dir,
            args=["--port", "0", "--metrics-port", "0", "--log-format", "json", *args],
        )
        self._started.append(proc)
        return proc.start(timeout=timeout)

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
        for i in range(spec.num_engines):
            env = {**BENCH_ENGINE_ENV, **spec.engine_env}
            self.engines.append(self._proc(f"bench-engine-{i}", "engine_svc", md, env, 240).address)
        if not spec.gateway and not spec.envoy:
            return
        self.tokenizer = self._proc("bench-tokenizer", "tokenizer_svc", md, {}, 90).address
        from common.redis_server import RedisServer

        redis = RedisServer().start()
        self._started.append(redis)
        gw_env = {**GATEWAY_ENV, **spec.gateway_env, "ADMIN_KEY": self.admin_key}
        self.gateway = self._proc(
            "bench-gateway",
            "gateway",
            [
                "--engines",
                ",".join(self.engines),
                "--tokenizer",
                self.tokenizer,
                "--redis-url",
                redis.url,
                "--http-port",
                "-1",
                *md,
            ],
            gw_env,
            120,
        ).address
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
    md = (("authorization", f"Bearer {admin_key}"),)
    channel = (
        grpc.secure_channel(admin_address, grpc.ssl_channel_credentials(ca_cert))
        if ca_cert
        else grpc.insecure_channel(admin_address)
    )
    with channel:
        admin = admin_pb2_grpc.RateLimitAdminStub(channel)
        for t in tenants:
            tid = t.name + run_tag
            limits = admin_pb2.LimitPolicy(
                requests_per_minute=t.rpm,
                tokens_per_minute=t.tpm,
                max_concurrent=t.max_concurrent,
                request_burst=t.request_burst,
            )
            admin.UpsertTenant(
                admin_pb2.Tenant(
                    id=tid,
                    limits=limits,
                    display_name=f"load test {t.name}",
                    priority=common_pb2.Priority.ValueType(t.priority_value),
                ),
                metadata=md,
                timeout=10,
            )
            t.key = admin.CreateApiKey(
                admin_pb2.CreateApiKeyRequest(tenant_id=tid, name="bench-load"),
                metadata=md,
                timeout=10,
            ).key
