"""deploy/compose.redis-cluster.yaml over deploy/compose.yaml, merged as Compose merges
them (no Docker engine here) and checked by structure.

The merge follows Compose's rules for what the override uses: maps merge, lists
of secrets, ports and volumes are joined, a ``!override`` value replaces the
base's. The merged file passes the base file's own reference and port checks;
its nodes render the same ACL as the Kubernetes nodes (common.redis_acl's
cluster model), the create service's arguments parse with the real command and
name every node, and the gateways, seeded by every node, start only after it.
"""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from common.config import load_config
from common.redis_acl import ADMIN_USER, SERVICE_USER
from common.redis_cluster_formation import create_parser
from ratelimit.config import RateLimitConfig
from tests.unit.deploy import test_docker_compose as base_checks
from tests.unit.deploy.helpers import DEPLOY, REDIS_PORT, acl_printf_lines, cluster_acl_lines

NODES = [f"redis-{i}" for i in range(6)]


class Override:
    """A value tagged ``!override`` (or ``!reset``): it replaces the base's."""

    def __init__(self, value: Any) -> None:
        self.value = value


class ComposeLoader(yaml.SafeLoader):
    pass


def _tagged(loader: yaml.SafeLoader, node: yaml.Node) -> Override:
    if isinstance(node, yaml.MappingNode):
        return Override(loader.construct_mapping(node, deep=True))
    if isinstance(node, yaml.SequenceNode):
        return Override(loader.construct_sequence(node, deep=True))
    return Override(loader.construct_scalar(node))  # type: ignore[arg-type]


ComposeLoader.add_constructor("!override", _tagged)
ComposeLoader.add_constructor("!reset", _tagged)


def compose_merge(base: Any, override: Any) -> Any:
    if isinstance(override, Override):
        return override.value
    if isinstance(base, dict) and isinstance(override, dict):
        out = dict(base)
        for k, v in override.items():
            out[k] = compose_merge(base[k], v) if k in base else _plain(v)
        return out
    if isinstance(base, list) and isinstance(override, list):
        return base + [v for v in override if v not in base]
    return _plain(override)


def _plain(value: Any) -> Any:
    if isinstance(value, Override):
        return value.value
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


@pytest.fixture(scope="module")
def merged() -> dict[str, Any]:
    base = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    override = yaml.load(  # a SafeLoader that also knows !override
        (DEPLOY / "compose.redis-cluster.yaml").read_text(), Loader=ComposeLoader
    )
    out = compose_merge(base, override)
    assert isinstance(out, dict)
    return out


def active(merged: dict[str, Any]) -> dict[str, Any]:
    """The services ``up`` starts (no profile)."""
    return {n: s for n, s in merged["services"].items() if not s.get("profiles")}


def test_the_merged_file_passes_the_base_checks(merged: dict[str, Any]) -> None:
    base_checks.test_every_long_running_service_has_a_healthcheck(merged)
    base_checks.test_only_envoy_publishes_ports_besides_monitoring(merged)
    base_checks.test_compose_references_resolve(merged)
    base_checks.test_internal_services_share_the_service_token_secret(merged)


def test_the_single_redis_is_off_and_nothing_waits_for_it(merged: dict[str, Any]) -> None:
    services = active(merged)
    assert "redis" not in services
    assert set(NODES) | {"redis-cluster-create"} <= set(services)
    for name, svc in services.items():
        assert "redis" not in svc.get("depends_on", {}), name


def test_the_nodes_render_the_same_acl_as_the_kubernetes_nodes(merged: dict[str, Any]) -> None:
    prefix = RateLimitConfig().key_prefix
    for name in NODES:
        node = merged["services"][name]
        script = " ".join(node["command"])
        assert acl_printf_lines(script) == cluster_acl_lines(prefix)
        files = [arg.split(")", 1)[0] for arg in script.split("$$(cat ")[1:]]
        assert files == [
            "/run/secrets/redis_password",
            "/run/secrets/redis_replication_password",
            "/run/secrets/redis_admin_password",
            "/run/secrets/redis_replication_password",  # masterauth
        ]
        assert {f.rsplit("/", 1)[1] for f in files} <= set(node["secrets"])
        assert set(node["secrets"]) <= set(merged["secrets"])
        for setting in (
            "masteruser llm-replication",
            "--cluster-enabled yes",
            "--cluster-require-full-coverage no",
            '--cluster-announce-hostname "$$NODE_NAME"',
            "--cluster-preferred-endpoint-type hostname",
            "--appendonly yes",
        ):
            assert setting in script, (name, setting)
        assert node["environment"] == {"NODE_NAME": name}  # announced: its service name
        assert {int(p) for p in node["expose"]} == {REDIS_PORT, REDIS_PORT + 10000}
        assert f"--user {SERVICE_USER} ping" in node["healthcheck"]["test"][1]
    volumes = {merged["services"][n]["volumes"][0].split(":")[0] for n in NODES}
    assert len(volumes) == len(NODES)  # a data volume each


def test_the_create_service_forms_every_node_then_the_gateways_start(
    merged: dict[str, Any],
) -> None:
    create = merged["services"]["redis-cluster-create"]
    assert create["entrypoint"] == ["python", "-m", "common.redis_cluster", "create"]
    args = create_parser().parse_args(create["command"])
    assert args.nodes == [f"{n}:{REDIS_PORT}" for n in NODES]
    assert (args.replicas, args.user) == (1, ADMIN_USER)
    assert args.password_file == "/run/secrets/redis_admin_password"
    assert create["secrets"] == ["redis_admin_password"]  # the operator's password only
    assert create["image"] == merged["services"]["gateway"]["image"]
    assert create["restart"] == "no"
    assert {k: v["condition"] for k, v in create["depends_on"].items()} == {
        n: "service_healthy" for n in NODES
    }
    gateway = merged["services"]["gateway"]
    assert gateway["depends_on"]["redis-cluster-create"] == {
        "condition": "service_completed_successfully"
    }
    assert {"redis_replication_password", "redis_admin_password"}.isdisjoint(gateway["secrets"])
    env = base_checks.env_of(gateway)
    config = load_config(
        RateLimitConfig,
        "ratelimit",
        env={k: v for k, v in env.items() if k.startswith("LLM_RATELIMIT_")},
    )
    assert config.redis_cluster
    assert config.redis_username == SERVICE_USER
    seeds = [config.redis_url.removeprefix("redis://").split("/")[0], *config.redis_startup_nodes]
    assert sorted(seeds) == [f"{n}:{REDIS_PORT}" for n in NODES]
