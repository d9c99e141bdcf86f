"""deploy/k8s-redis-cluster: the stack with a Valkey cluster instead of the single Redis.

The overlay is rendered here (``tests.unit.deploy.kustomize``, compared with
``kubectl kustomize`` where kubectl is installed), every object validated
against the Kubernetes schemas, and cross-checked: the ACL the nodes render is
common.redis_acl's cluster model, each password comes from a Secret only the
users that need it mount, the gateways' config loads with the real config class
and seeds every node, the create Job's arguments parse with the real command
and name every node, the PodDisruptionBudget lets one node go at a time, and the
NetworkPolicies allow exactly the cluster's call graph.
"""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]  # no py.typed
import pytest
import yaml
from redis.asyncio.cluster import RedisCluster

from common.config import load_config
from common.redis_acl import ADMIN_USER, SERVICE_USER
from common.redis_cluster_formation import create_parser
from ratelimit.config import RateLimitConfig
from ratelimit.factory import make_client
from tests.unit.deploy.helpers import DEPLOY, REDIS_PORT, acl_printf_lines, cluster_acl_lines
from tests.unit.deploy.kustomize import render
from tests.unit.deploy.test_k8s import VERSION, _allowed, container, find, pod_spec

OVERLAY = DEPLOY / "k8s-redis-cluster"
Doc = dict[str, Any]
BUS_PORT = REDIS_PORT + 10000
NAME = "app.kubernetes.io/name"


@pytest.fixture(scope="module")
def docs() -> list[Doc]:
    return render(OVERLAY)


def env_of(c: Doc) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in c.get("env", [])}


def node_names(docs: list[Doc]) -> list[str]:
    """``<pod>.<service>:<port>`` of every node, as the StatefulSet names its pods."""
    sts = find(docs, "StatefulSet", "redis-cluster")
    return [
        f"redis-cluster-{i}.{sts['spec']['serviceName']}:{REDIS_PORT}"
        for i in range(sts["spec"]["replicas"])
    ]


@pytest.mark.parametrize("directory", [DEPLOY / "k8s", OVERLAY], ids=lambda p: p.name)
def test_the_python_rendering_is_kubectls(directory: Path) -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("no kubectl here; the Python rendering is checked by the other tests")
    out = subprocess.run(
        [kubectl, "kustomize", str(directory)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    theirs = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(out) if d}
    assert theirs == {(d["kind"], d["metadata"]["name"]): d for d in render(directory)}


def test_every_object_is_valid_and_the_single_redis_is_gone(docs: list[Doc]) -> None:
    for d in docs:
        kubernetes_validate.validate(d, VERSION, strict=True)
        assert d["metadata"].get("namespace", "llm-stack") == "llm-stack"
    names = {(d["kind"], d["metadata"]["name"]) for d in docs}
    single = {("StatefulSet", "redis"), ("Service", "redis"), ("NetworkPolicy", "redis-ingress")}
    assert not names & single
    base = {(d["kind"], d["metadata"]["name"]) for d in render(DEPLOY / "k8s")}
    added = {
        ("StatefulSet", "redis-cluster"),
        ("Service", "redis-cluster"),
        ("PodDisruptionBudget", "redis-cluster"),
        ("Job", "redis-cluster-create"),
        ("Secret", "llm-redis-cluster"),
        ("NetworkPolicy", "redis-cluster-ingress"),
        ("NetworkPolicy", "redis-cluster-egress"),
    }
    assert names == (base - single) | added
    for d in docs:  # nothing points at the single Redis any more
        if d["kind"] != "ConfigMap":
            assert "redis:6379" not in yaml.safe_dump(d), d["metadata"]["name"]


def test_six_cluster_nodes_behind_a_headless_service(docs: list[Doc]) -> None:
    sts = find(docs, "StatefulSet", "redis-cluster")
    svc = find(docs, "Service", sts["spec"]["serviceName"])
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert sts["spec"]["replicas"] == 6
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["publishNotReadyAddresses"] is True  # met before they are ready
    assert svc["spec"]["selector"].items() <= labels.items()
    c = container(sts, "redis")
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"redis": REDIS_PORT, "bus": BUS_PORT}
    assert {p["targetPort"] for p in svc["spec"]["ports"]} == set(ports)
    script = " ".join(c["args"])
    for setting in (
        "--cluster-enabled yes",
        "--cluster-require-full-coverage no",  # healthy shards answer while one fails over
        '--cluster-announce-hostname "${POD_NAME}.redis-cluster"',
        "--cluster-preferred-endpoint-type hostname",
        "--cluster-config-file /data/nodes.conf",
        "--appendonly yes",  # tenants and keys survive losing a shard's both nodes' memory
    ):
        assert setting in script
    (pod_name,) = [e for e in c["env"] if e["name"] == "POD_NAME"]
    assert pod_name["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    (data,) = [m for m in c["volumeMounts"] if m["mountPath"] == "/data"]
    assert data["name"] in {t["metadata"]["name"] for t in sts["spec"]["volumeClaimTemplates"]}
    spread = pod_spec(sts)["topologySpreadConstraints"]
    assert all(s["labelSelector"]["matchLabels"].items() <= labels.items() for s in spread)
    pdb = find(docs, "PodDisruptionBudget", "redis-cluster")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pdb["spec"]["maxUnavailable"] == 1  # never a primary and its replica at once


def secret_key_of(docs: list[Doc], workload: Doc, c: Doc, path: str) -> tuple[str, str]:
    """(Secret, key) a container reads at ``path``, checking the key exists."""
    mount_path, _, name = path.rpartition("/")
    (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == mount_path]
    (volume,) = [v for v in pod_spec(workload)["volumes"] if v["name"] == mount["name"]]
    items = {i["path"]: i["key"] for i in volume["secret"].get("items", [])}
    if volume["secret"].get("items"):
        assert name in items, f"{path} is not projected"
    key = items.get(name, name)
    secret = find(docs, "Secret", volume["secret"]["secretName"])
    assert key in secret["stringData"], f"{secret['metadata']['name']} has no {key}"
    return secret["metadata"]["name"], key


def test_the_nodes_run_the_stacks_cluster_acl(docs: list[Doc]) -> None:
    sts = find(docs, "StatefulSet", "redis-cluster")
    c = container(sts, "redis")
    script = " ".join(c["args"])
    assert acl_printf_lines(script) == cluster_acl_lines(RateLimitConfig().key_prefix)
    files = [arg.split(")", 1)[0] for arg in script.split("$(cat ")[1:]]
    service, replication, admin, masterauth = files
    assert replication == masterauth  # what the replicas authenticate with
    assert "printf 'masteruser llm-replication\\nmasterauth %s\\n'" in script
    assert "exec valkey-server /run/redis/auth.conf --aclfile /run/redis/users.acl" in script
    keys = [secret_key_of(docs, sts, c, f) for f in (service, replication, admin)]
    assert keys == [
        ("llm-redis", "password"),
        ("llm-redis-cluster", "replication-password"),
        ("llm-redis-cluster", "admin-password"),
    ]
    # the gateways authenticate as the service user with the same password, and hold
    # neither of the cluster's other passwords
    gw = find(docs, "Deployment", "gateway")
    env = env_of(container(gw, "gateway"))
    assert env["LLM_RATELIMIT_REDIS_USERNAME"] == SERVICE_USER
    gateway_secret = secret_key_of(
        docs, gw, container(gw, "gateway"), env["LLM_RATELIMIT_REDIS_PASSWORD_FILE"]
    )
    assert gateway_secret == keys[0]
    assert "llm-redis-cluster" not in yaml.safe_dump(gw)
    probe = " ".join(c["readinessProbe"]["exec"]["command"])
    assert f"valkey-cli --user {SERVICE_USER} ping | grep -q PONG" in probe
    assert f'VALKEYCLI_AUTH="$(cat {service})"' in probe


def test_the_gateways_config_seeds_every_node(docs: list[Doc], tmp_path: Path) -> None:
    gw = find(docs, "Deployment", "gateway")
    env = env_of(container(gw, "gateway"))
    stack = tmp_path / "stack.yaml"
    stack.write_text(find(docs, "ConfigMap", "llm-stack-config")["data"]["stack.yaml"])
    config = load_config(
        RateLimitConfig,
        "ratelimit",
        path=stack,
        env={k: v for k, v in env.items() if k.startswith("LLM_RATELIMIT_")},
    )
    assert config.redis_cluster
    seeds = [config.redis_url.removeprefix("redis://").split("/")[0], *config.redis_startup_nodes]
    assert sorted(seeds) == sorted(node_names(docs))
    client = make_client(dataclasses.replace(config, redis_password_file=""))
    assert isinstance(client, RedisCluster)
    assert len(client.startup_nodes) == 6


def test_the_create_job_forms_every_node_as_the_operator(docs: list[Doc]) -> None:
    job = find(docs, "Job", "redis-cluster-create")
    c = container(job, "create")
    assert c["command"] == ["python", "-m", "common.redis_cluster", "create"]
    args = create_parser().parse_args(c["args"])
    assert sorted(args.nodes) == sorted(node_names(docs))
    assert args.nodes == node_names(docs)  # 0..2 primaries, 3..5 their replicas
    assert len(args.nodes) % (1 + args.replicas) == 0
    assert args.replicas == 1
    assert args.user == ADMIN_USER
    assert secret_key_of(docs, job, c, args.password_file) == (
        "llm-redis-cluster",
        "admin-password",
    )
    assert c["image"] == container(find(docs, "Deployment", "gateway"), "gateway")["image"]
    assert pod_spec(job)["restartPolicy"] == "OnFailure"
    assert pod_spec(job)["securityContext"]["runAsNonRoot"] is True
    assert c["securityContext"]["allowPrivilegeEscalation"] is False


def test_network_policies_allow_only_the_clusters_call_graph(docs: list[Doc]) -> None:
    apps = ["envoy", "gateway", "engine", "tokenizer", "redis-cluster", "redis-cluster-create"]
    labels = {a: {NAME: a, "app.kubernetes.io/part-of": "llm-stack"} for a in apps}
    expected = {
        ("gateway", REDIS_PORT),
        ("redis-cluster-create", REDIS_PORT),
        ("redis-cluster", REDIS_PORT),
        ("redis-cluster", BUS_PORT),
    }
    for port in (REDIS_PORT, BUS_PORT):
        assert not _allowed(docs, None, labels["redis-cluster"], port)  # nothing from outside
        for src in apps:
            allowed = _allowed(docs, labels[src], labels["redis-cluster"], port)
            assert allowed == ((src, port) in expected), (src, port)
    (egress,) = [
        d["spec"]
        for d in docs
        if d["kind"] == "NetworkPolicy"
        and "Egress" in d["spec"]["policyTypes"]
        and d["spec"]["podSelector"].get("matchLabels") == {NAME: "redis-cluster"}
    ]
    (rule,) = egress["egress"]
    assert rule["to"] == [{"podSelector": {"matchLabels": {NAME: "redis-cluster"}}}]
    assert {p["port"] for p in rule["ports"]} == {REDIS_PORT, BUS_PORT}
