"""SMG (the ``smg`` wheel's Rust gateway) in front of an engine, as a child process.

    with SmgProcess(["grpc://127.0.0.1:50051"], model_dir, log_dir=d) as smg:
        smg.url            # "http://127.0.0.1:<port>": its OpenAI HTTP API

``bench.gateway_bench --engine stock-vllm`` puts it in front of the same stock vLLM
server the gateway fronts, so both gateways meet one engine in one run. It tokenizes
with the model directory's own tokenizer, as the gateway does with ``--model-dir``.
Its Prometheus listener gets a free port of its own (the default, 29000, could be
taken by another run on the machine).

With ``tenant`` (``SmgTenant``) it does what the gateway does on the same request:
it takes only that tenant's API key (``--tenant-api-key``) and keeps the tenant inside
per-minute token and request buckets, reserved before the engine call and settled
after it (``--tenant-rate-limit-enabled``, its YAML written beside the log).
"""

from __future__ import annotations

import secrets
import subprocess
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import yaml

from common.config import ROOT
from common.pgroup import ChildStartError, LoggedChild
from common.redis_server import free_ports

SMG = ROOT / ".venv" / "bin" / "smg"


class SmgStartError(ChildStartError):
    """SMG exited or did not list its model in time; carries its log tail."""


@dataclass(frozen=True)
class SmgTenant:
    """One tenant SMG authenticates and limits: its per-minute limits (0 and 0: none,
    SMG then only checks the key), id and API key (SMG's tenant key for it is
    ``auth:<tenant_id>``; a fresh key by default)."""

    tokens_per_minute: int
    requests_per_minute: int
    tenant_id: str = "bench"
    key: str = field(default_factory=lambda: f"sk-smg-{secrets.token_hex(16)}")

    def policy_yaml(self) -> str:
        """SMG's tenant-rate-limit YAML: this tenant's buckets, and a default policy
        of one request a minute for any other tenant key SMG resolves."""
        own = {
            "tenant_key": f"auth:{self.tenant_id}",
            "tokens_per_minute": self.tokens_per_minute,
            "requests_per_minute": self.requests_per_minute,
        }
        starved = {"tokens_per_minute": 1, "requests_per_minute": 1}
        return str(yaml.safe_dump({"default_policy": starved, "tenants": [own]}))

    @property
    def limited(self) -> bool:
        """Whether SMG keeps this tenant's buckets (SMG takes no 0 for either)."""
        return bool(self.tokens_per_minute or self.requests_per_minute)

    def args(self, policy_path: Path) -> list[str]:
        """SMG's flags for this tenant, its policy read from ``policy_path`` when
        ``limited``."""
        key = ["--tenant-api-key", f"{self.tenant_id}:{self.key}"]
        if not self.limited:
            return key
        return [*key, "--tenant-rate-limit-enabled", "--tenant-rate-limit-config", str(policy_path)]


def smg_command(
    worker_urls: list[str],
    model_dir: Path,
    port: int,
    prometheus_port: int,
    host: str = "127.0.0.1",
    log_level: str = "warn",
    smg: Path = SMG,
) -> list[str]:
    """``smg launch``'s command line: ``worker_urls`` (``grpc://host:port``) behind its
    OpenAI API on ``host:port``, the tokenizer from ``model_dir``."""
    return [
        str(smg),
        "launch",
        "--worker-urls",
        *worker_urls,
        "--model-path",
        str(model_dir),
        "--host",
        host,
        "--port",
        str(port),
        "--prometheus-host",
        host,
        "--prometheus-port",
        str(prometheus_port),
        "--log-level",
        log_level,
    ]


def models_listed(url: str, timeout: float = 1.0) -> bool:
    """True when ``GET url/v1/models`` answers 200 with at least one model (SMG lists
    a model once a worker has registered)."""
    try:
        with urllib.request.urlopen(f"{url}/v1/models", timeout=timeout) as resp:
            return resp.status == 200 and b'"id"' in resp.read()
    except (OSError, urllib.error.URLError):
        return False


@dataclass
class SmgProcess(LoggedChild):
    """``smg launch`` over ``worker_urls`` on free ports, logging to ``log_dir``."""

    worker_urls: list[str]
    model_dir: Path
    log_dir: Path
    name: str = "smg"
    host: str = "127.0.0.1"
    port: int = 0
    prometheus_port: int = 0
    stop_timeout: float = 10.0
    proc: subprocess.Popen[bytes] | None = None
    command: list[str] = field(default_factory=list)
    log_path: Path = field(init=False)
    _log: IO[bytes] | None = None
    tenant: SmgTenant | None = None
    start_error = SmgStartError

    def __post_init__(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.log_dir / f"{self.name}.log"
        if not self.port or not self.prometheus_port:
            self.port, self.prometheus_port = free_ports(2, self.host)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 120.0) -> SmgProcess:
        """Spawn it and wait until ``/v1/models`` lists the workers' model (SMG lists
        models without a key, with a tenant too)."""
        if not SMG.is_file():
            raise SmgStartError(f"no {SMG}: the smg wheel is not installed in the venv")
        self.command = smg_command(
            self.worker_urls, self.model_dir, self.port, self.prometheus_port, self.host
        )
        if self.tenant is not None:
            policy = self.log_dir / f"{self.name}-tenant-rate-limit.yaml"
            if self.tenant.limited:
                policy.write_text(self.tenant.policy_yaml())
            self.command += self.tenant.args(policy)
        self.spawn(self.command, cwd=ROOT)
        self.wait_ready(lambda: models_listed(self.url), timeout, poll_s=0.5)
        return self

    def __enter__(self) -> SmgProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
