"""Shared facts for the offline deploy checks: where things are, which ports are whose."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from common.config import ROOT

DEPLOY = ROOT / "deploy"
DESCRIPTOR_SET = ROOT / "build" / "llm_v1.pb"

# the documented default ports (README); config/stack.yaml wins for the sections it has.
DESIGN_PORTS: dict[str, dict[str, int]] = {
    "gateway": {"port": 50051, "metrics_port": 9451, "http_port": 8000},
    "tokenizer": {"port": 50061, "metrics_port": 9461},
    "engine": {"port": 50071, "metrics_port": 9471},
}
ENVOY_PUBLIC_PORT = 8080
ENVOY_ADMIN_PORT = 9901
ENVOY_STATS_PORT = 9902
REDIS_PORT = 6379
HEALTH_SERVICE = {
    "gateway": "llm.v1.Gateway",
    "tokenizer": "llm.v1.Tokenizer",
    "engine": "llm.v1.Engine",
}


def service_ports(section: str) -> dict[str, int]:
    """gRPC, metrics (and HTTP) ports of a service: config/stack.yaml, else the defaults."""
    doc = yaml.safe_load((ROOT / "config" / "stack.yaml").read_text()) or {}
    ports = dict(DESIGN_PORTS[section])
    for key in ports:
        if key in (doc.get(section) or {}):
            ports[key] = int(doc[section][key])
    return ports


def load_yaml_docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


# Envoy's own stats the dashboard reads, as /stats/prometheus names them
# (tests/integration/deploy/test_envoy_edge.py checks them on a real Envoy).
ENVOY_DASHBOARD_METRICS = frozenset(
    {
        "envoy_cluster_upstream_rq_total",
        "envoy_cluster_upstream_rq_retry",
        "envoy_cluster_outlier_detection_ejections_active",
        "envoy_cluster_membership_healthy",
        "envoy_cluster_membership_total",
    }
)


def acl_printf_lines(script: str) -> list[str]:
    """The lines of the first ``printf '...'`` format in a start script (the ACL file
    the deploy scripts render, one ``user`` per line)."""
    return script.split("printf '", 1)[1].split("'", 1)[0].split("\\n")[:-1]


def cluster_acl_lines(key_prefix: str) -> list[str]:
    """The ACL file of a cluster node, as common.redis_acl words it, with ``>%s`` for
    each password (the scripts fill them in from the secrets in this order: the service
    user's, the replication user's, the operator's)."""
    from common.redis_acl import (
        ADMIN_RULES,
        ADMIN_USER,
        REPLICATION_RULES,
        REPLICATION_USER,
        SERVICE_USER,
        service_rules,
    )

    return [
        "user default off resetkeys -@all",
        f"user {SERVICE_USER} on >%s {service_rules(key_prefix, cluster=True)}",
        f"user {REPLICATION_USER} on >%s {REPLICATION_RULES}",
        f"user {ADMIN_USER} on >%s {ADMIN_RULES}",
    ]


def require_tool(name: str, why: str, found: str | None = None) -> str:
    """The path of the command ``name`` (``found`` when the caller looked further than
    PATH); without one, a skip that names the tool, what needs it and how to get it, and
    a failure under CI=true, where a skip would hide a part of the set-up."""
    path = found or shutil.which(name)
    if path is None:
        message = f"{name} not found: {why}"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return path


OPENSSL_WHY = (
    "make run and these tests make the local CA and Envoy's certificate with it "
    "(Debian/Ubuntu: apt-get install openssl)"
)
