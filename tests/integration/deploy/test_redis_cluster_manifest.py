"""deploy/k8s-redis-cluster run for real: the nodes' own start script, the create Job's
own command, the gateways' own config (no container engine or Kubernetes here).

Six servers start from the StatefulSet's shell script as written (the ACL file
and the replication config rendered by its ``printf`` from the Secrets' files),
with only the paths pointed at a temporary directory, the ports at free loopback
ports, and the endpoint type at addresses (the pods' DNS names do not resolve
here). The Job's arguments, with the nodes' addresses, form the cluster; then
the rate-limit stack, configured from the ConfigMap and the gateway's environment,
authenticates a key and reserves and settles on it as the service user; the
service user is refused FLUSHALL; no node logged an ACL refusal, and every replica
is in sync with its primary.
"""

from __future__ import annotations

import asyncio
import secrets
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from redis import Redis
from redis.exceptions import NoPermissionError, RedisError

from common.config import load_config
from common.pgroup import LoggedChild
from common.redis_acl import ADMIN_USER, SERVICE_USER
from common.redis_cluster_formation import Cluster
from common.redis_server import find_server_binary, free_ports
from ratelimit.config import LimitPolicy, RateLimitConfig, Tenant
from ratelimit.factory import RateLimitStack
from ratelimit.tenancy.records import KeyRole
from tests.unit.deploy.helpers import DEPLOY
from tests.unit.deploy.kustomize import render

pytestmark = pytest.mark.integration
Doc = dict[str, Any]


def find(docs: list[Doc], kind: str, name: str) -> Doc:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


@dataclass
class ScriptNode(LoggedChild):
    """One node started by the StatefulSet's script under ``/bin/sh``."""

    name: str
    root: Path
    port: int
    bus_port: int
    log_path: Path = field(init=False)

    def __post_init__(self) -> None:
        self.log_path = self.root / "node.log"

    def start(self, script: str, env: dict[str, str], password: str) -> None:
        local = (
            script.replace("/etc/redis-secret", str(self.root.parent / "redis-secret"))
            .replace("/etc/redis-cluster-secret", str(self.root.parent / "redis-cluster-secret"))
            .replace("/run/redis", str(self.root / "run"))
            .replace("/data", str(self.root / "data"))
        )
        local += (
            f" --port {self.port} --cluster-port {self.bus_port} --bind 127.0.0.1"
            " --cluster-preferred-endpoint-type ip"
        )
        for d in ("run", "data"):
            (self.root / d).mkdir(parents=True)
        self.spawn(["/bin/sh", "-c", local], env={**env, "POD_NAME": self.name})

        def answers() -> bool:
            try:
                with Redis(port=self.port, username=SERVICE_USER, password=password) as c:
                    return bool(c.ping())
            except RedisError:
                return False

        self.wait_ready(answers, timeout=20)


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[tuple[list[ScriptNode], dict[str, str], list[Doc]]]:
    docs = render(DEPLOY / "k8s-redis-cluster")
    sts = find(docs, "StatefulSet", "redis-cluster")
    (c,) = sts["spec"]["template"]["spec"]["containers"]
    script = " ".join(c["args"])
    passwords = {"password": secrets.token_hex(32)}
    (tmp_path / "redis-secret").mkdir()
    (tmp_path / "redis-secret" / "password").write_text(passwords["password"])
    (tmp_path / "redis-cluster-secret").mkdir()
    for key in find(docs, "Secret", "llm-redis-cluster")["stringData"]:
        passwords[key] = secrets.token_hex(32)
        (tmp_path / "redis-cluster-secret" / key).write_text(passwords[key])
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "valkey-server").symlink_to(find_server_binary())
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin"}
    ports = free_ports(2 * sts["spec"]["replicas"])
    started = []
    try:
        for i in range(sts["spec"]["replicas"]):
            node = ScriptNode(
                f"redis-cluster-{i}", tmp_path / f"node-{i}", *ports[2 * i : 2 * i + 2]
            )
            started.append(node)
            node.start(script, env, passwords["password"])
        yield started, passwords, docs
    finally:
        for node in started:
            node.stop()


def test_the_manifests_form_a_working_acl_cluster(
    nodes: tuple[list[ScriptNode], dict[str, str], list[Doc]], tmp_path: Path
) -> None:
    started, passwords, docs = nodes
    job = find(docs, "Job", "redis-cluster-create")
    (c,) = job["spec"]["template"]["spec"]["containers"]
    local = {f"{n.name}.redis-cluster:6379": f"127.0.0.1:{n.port}@{n.bus_port}" for n in started}
    args = [
        local.get(a, a.replace("/etc/redis-cluster-secret", str(tmp_path / "redis-cluster-secret")))
        for a in c["args"]
    ]
    assert set(local.values()) <= set(args)  # the Job names every node
    assert c["command"][:3] == ["python", "-m", "common.redis_cluster"]
    formed = subprocess.run(
        [sys.executable, *c["command"][1:], *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert formed.returncode == 0, formed.stderr
    cluster = Cluster(
        [("127.0.0.1", n.port, n.bus_port) for n in started],
        3,
        username=ADMIN_USER,
        password=passwords["admin-password"],
    )
    assert cluster.healthy()

    # the gateway's configuration (ConfigMap + env), pointed at the local nodes
    gw = find(docs, "Deployment", "gateway")
    (gc,) = [x for x in gw["spec"]["template"]["spec"]["containers"] if x["name"] == "gateway"]
    env = {e["name"]: e["value"] for e in gc["env"] if e["name"].startswith("LLM_RATELIMIT_")}
    password_file = tmp_path / "redis-secret" / "password"
    env["LLM_RATELIMIT_REDIS_PASSWORD_FILE"] = str(password_file)
    for name, address in local.items():
        env = {k: v.replace(name, address.split("@")[0]) for k, v in env.items()}
    stack_yaml = tmp_path / "stack.yaml"
    stack_yaml.write_text(find(docs, "ConfigMap", "llm-stack-config")["data"]["stack.yaml"])
    config = load_config(RateLimitConfig, "ratelimit", path=stack_yaml, env=env)
    assert config.redis_cluster
    assert config.redis_username == SERVICE_USER
    run_the_limits(config)
    cluster.wait_replicated()
    for i in range(len(started)):  # the replicas' sync and the limits' calls all passed
        with cluster.client(i) as admin:
            assert admin.acl_log() == [], started[i].name
    service = Redis(port=started[0].port, username=SERVICE_USER, password=passwords["password"])
    with service, pytest.raises(NoPermissionError):
        service.flushall()


def run_the_limits(config: RateLimitConfig) -> None:
    """Authenticate a key, reserve and settle on it, as the gateway does."""

    async def go() -> None:
        stack = RateLimitStack.from_config(config)
        await stack.start(wait_s=10)
        try:
            tenant = await stack.registry.upsert_tenant(
                Tenant("acme", LimitPolicy(requests_per_minute=60))
            )
            plaintext, _ = await stack.registry.create_key("acme", "ci", KeyRole.TENANT)
            assert (await stack.registry.authenticate(plaintext)).tenant == tenant
            decision = await stack.limiter.reserve(tenant, 10)
            assert decision.source == "redis"
            assert decision.reservation is not None
            await stack.limiter.settle(decision.reservation, prompt_tokens=5, completion_tokens=1)
            assert (await stack.limiter.usage(tenant)).requests_total == 1
        finally:
            await stack.aclose()

    asyncio.run(go())
