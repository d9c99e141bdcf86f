"""deploy/k8s validated offline against the Kubernetes schemas, plus cross-checks."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]  # no py.typed
import pytest
import yaml
from kubernetes_validate import utils as kv_utils  # type: ignore[import-untyped]

from common.config import load_config
from common.redis_acl import SERVICE_USER, service_rules
from deploy.envoy.config import (
    CONTAINER_PRESET,
    CONTAINER_TLS_DIR,
    Endpoint,
    render_config,
    tls_context,
)
from ratelimit.config import RateLimitConfig
from tests.unit.deploy.helpers import DEPLOY, HEALTH_SERVICE, load_yaml_docs, service_ports

K8S = DEPLOY / "k8s"
VERSION = kv_utils.latest_version()
Doc = dict[str, Any]


@pytest.fixture(scope="module")
def docs() -> list[Doc]:
    out = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name != "kustomization.yaml":
            out.extend(load_yaml_docs(path))
    return out


def find(docs: list[Doc], kind: str, name: str) -> Doc:
    for d in docs:
        if d["kind"] == kind and d["metadata"]["name"] == name:
            return d
    raise AssertionError(f"no {kind}/{name}")


def pod_spec(doc: Doc) -> Doc:
    spec: Doc = doc["spec"]["template"]["spec"]
    return spec


def container(doc: Doc, name: str) -> Doc:
    for c in pod_spec(doc)["containers"]:
        if c["name"] == name:
            return dict[str, Any](c)
    raise AssertionError(f"no container {name}")


def test_every_manifest_is_valid_for_the_schema(docs: list[Doc]) -> None:
    assert len(docs) >= 15
    for d in docs:
        kubernetes_validate.validate(d, VERSION, strict=True)


def test_the_validator_catches_a_misspelled_field(docs: list[Doc]) -> None:
    bad = copy.deepcopy(find(docs, "Deployment", "gateway"))
    bad["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grcp"] = {"port": 1}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, VERSION, strict=True)


def test_kustomization_lists_every_manifest() -> None:
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    files = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kust["resources"]) == files
    assert kust["namespace"] == "llm-stack"


def test_all_objects_live_in_the_namespace(docs: list[Doc]) -> None:
    for d in docs:
        if d["kind"] != "Namespace":
            assert d["metadata"]["namespace"] == "llm-stack", d["metadata"]["name"]


def test_the_default_engine_is_the_native_one_on_cpu(docs: list[Doc], tmp_path: Path) -> None:
    """deploy/k8s runs our engine on CPU nodes; TensorRT-LLM on GPUs is the overlay
    deploy/k8s-trtllm (tests/unit/deploy/test_trtllm.py)."""
    engine = find(docs, "Deployment", "engine")
    c = container(engine, "engine")
    assert "nvidia.com/gpu" not in c["resources"]["limits"]
    assert c["image"].startswith("llm-stack/engine:")
    assert "tolerations" not in pod_spec(engine)
    # the backend comes from the config file the pod mounts, not from the image
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert "LLM_ENGINE_BACKEND" not in env
    stack = tmp_path / "stack.yaml"
    stack.write_text(find(docs, "ConfigMap", "llm-stack-config")["data"]["stack.yaml"])
    section = yaml.safe_load(stack.read_text())["engine"]
    assert section["backend"] == "native"
    mount = next(m for m in c["volumeMounts"] if m["name"] == "config")
    assert env["LLM_CONFIG"] == f"{mount['mountPath']}/stack.yaml"


def test_configmap_loads_with_the_real_config_classes(docs: list[Doc], tmp_path: Path) -> None:
    stack = tmp_path / "stack.yaml"
    stack.write_text(find(docs, "ConfigMap", "llm-stack-config")["data"]["stack.yaml"])
    rl = load_config(RateLimitConfig, "ratelimit", path=stack, env={})
    assert rl.redis_url == "redis://redis:6379/0"
    # imported, never skipped: a config class that cannot load is a failure here
    from engine_svc.config import EngineServiceConfig
    from engine_svc.core.config import EngineConfig
    from tokenizer_svc.config import TokenizerConfig

    tok = load_config(TokenizerConfig, "tokenizer", path=stack, env={})
    assert (tok.port, tok.metrics_port) == tuple(service_ports("tokenizer").values())
    eng = load_config(EngineServiceConfig, "engine", path=stack, env={})
    assert eng.backend == "native"
    assert (eng.port, eng.metrics_port) == tuple(service_ports("engine").values())
    core = load_config(EngineConfig, "engine_core", path=stack, env={})
    assert core.device == "cpu"
    # the KV budget is bytes, inside the pod's memory limit (a fraction would be of the node's)
    limit = container(find(docs, "Deployment", "engine"), "engine")["resources"]["limits"]
    assert 0 < core.kv_cache_memory_bytes < int(limit["memory"].removesuffix("Gi")) * 2**30


def test_gateway_has_hpa_pdb_and_a_headless_service(docs: list[Doc]) -> None:
    gw = find(docs, "Deployment", "gateway")
    labels = gw["spec"]["template"]["metadata"]["labels"]
    hpa = find(docs, "HorizontalPodAutoscaler", "gateway")
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "gateway",
    }
    assert 2 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]
    pdb = find(docs, "PodDisruptionBudget", "gateway")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pdb["spec"]["minAvailable"] < hpa["spec"]["minReplicas"]  # drains can proceed
    svc = find(docs, "Service", "gateway")
    assert svc["spec"]["clusterIP"] == "None"  # Envoy sees every replica
    # the Envoy image's preset points at exactly this Service and port
    (endpoint,) = [Endpoint.parse(e) for e in CONTAINER_PRESET["gateway"]]
    assert endpoint == Endpoint("gateway", svc["spec"]["ports"][0]["port"])
    assert endpoint.port == service_ports("gateway")["port"]
    (http,) = [Endpoint.parse(e) for e in CONTAINER_PRESET["gateway_http"]]
    (svc_http,) = [p for p in svc["spec"]["ports"] if p["name"] == "http"]
    assert http == Endpoint("gateway", svc_http["port"])
    assert http.port == service_ports("gateway")["http_port"]
    c = container(gw, "gateway")
    assert {"name": "http", "containerPort": http.port} in c["ports"]


def test_engines_scale_on_queue_depth_and_kv_usage_from_their_own_metrics(
    docs: list[Doc],
) -> None:
    engine = find(docs, "Deployment", "engine")
    labels = engine["spec"]["template"]["metadata"]["labels"]
    hpa = find(docs, "HorizontalPodAutoscaler", "engine")
    assert hpa["spec"]["scaleTargetRef"]["name"] == "engine"
    assert 2 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]
    pdb = find(docs, "PodDisruptionBudget", "engine")
    assert pdb["spec"]["maxUnavailable"] < hpa["spec"]["minReplicas"]  # never all at once
    wanted = {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"}
    assert wanted == {"engine_num_requests_waiting", "engine_kv_cache_usage_perc"}
    # prometheus-adapter serves exactly those names, from series the engines export
    adapter = yaml.safe_load(
        find(docs, "ConfigMap", "llm-prometheus-adapter")["data"]["config.yaml"]
    )
    served = {r["name"]["as"]: r for r in adapter["rules"]}
    assert set(served) == wanted
    exported = (Path(__file__).parents[3] / "engine_svc" / "metrics.py").read_text()
    for rule in served.values():
        series = rule["seriesQuery"].split("{")[0].strip("'")
        assert f'"{series}"' in exported, f"{series}: no such engine metric"
        assert set(rule["resources"]["overrides"]) == {"namespace", "pod"}  # per pod
    # the engines are spread over zones and nodes, and count as ready only once warm
    spread = pod_spec(engine)["topologySpreadConstraints"]
    assert {c["topologyKey"] for c in spread} == {
        "topology.kubernetes.io/zone",
        "kubernetes.io/hostname",
    }
    assert all(c["labelSelector"]["matchLabels"].items() <= labels.items() for c in spread)
    probe = container(engine, "engine")["readinessProbe"]["grpc"]
    assert probe["service"] == HEALTH_SERVICE["engine"]  # SERVING after load + warm-up


def test_admin_key_comes_from_a_secret(docs: list[Doc]) -> None:
    c = container(find(docs, "Deployment", "gateway"), "gateway")
    (admin,) = [e for e in c["env"] if e["name"] == "ADMIN_KEY"]
    ref = admin["valueFrom"]["secretKeyRef"]
    secret = find(docs, "Secret", ref["name"])
    assert ref["key"] in secret["stringData"]
    # no plaintext admin key anywhere in a pod spec
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet"):
            assert "sk-llm-" not in yaml.safe_dump(d)


@pytest.mark.parametrize("name", ["tokenizer", "engine", "gateway"])
def test_internal_calls_share_the_service_token_secret(docs: list[Doc], name: str) -> None:
    """Engine and tokenizer require it, the gateway sends it: one Secret, mounted as a file."""
    deployment = find(docs, "Deployment", name)
    c = container(deployment, name)
    (env,) = [e for e in c["env"] if e["name"] == f"LLM_{name.upper()}_SERVICE_TOKEN_FILE"]
    path = Path(env["value"])
    (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == str(path.parent)]
    (volume,) = [v for v in pod_spec(deployment)["volumes"] if v["name"] == mount["name"]]
    secret = find(docs, "Secret", volume["secret"]["secretName"])
    assert path.name in secret["stringData"]


@pytest.mark.parametrize("name", ["tokenizer", "engine", "gateway"])
def test_probes_are_grpc_health_on_the_service_port(docs: list[Doc], name: str) -> None:
    c = container(find(docs, "Deployment", name), name)
    port = service_ports(name)["port"]
    names = {"port": "grpc", "metrics_port": "metrics", "http_port": "http"}
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {
        names[k]: v for k, v in service_ports(name).items()
    }
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert c[probe]["grpc"]["port"] == port, probe
    # ready = the service itself is SERVING (NOT_SERVING while warming or draining)
    assert c["readinessProbe"]["grpc"]["service"] == HEALTH_SERVICE[name]


def test_envoy_probes_use_the_stats_listener_not_the_admin_port(docs: list[Doc]) -> None:
    c = container(find(docs, "Deployment", "envoy"), "envoy")
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"public": 8080, "stats": 9902}
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "stats"}


def test_envoy_serves_tls_with_the_certificate_of_a_tls_secret(docs: list[Doc]) -> None:
    """The kubernetes.io/tls Secret is mounted where the image's config reads the
    certificate and key, read-only, readable by Envoy's group; the Service publishes
    the TLS listener on 443."""
    envoy = find(docs, "Deployment", "envoy")
    c = container(envoy, "envoy")
    (certificate,) = tls_context(render_config(**CONTAINER_PRESET))["common_tls_context"][
        "tls_certificates"
    ]
    cert = Path(certificate["certificate_chain"]["filename"])
    key = Path(certificate["private_key"]["filename"])
    assert cert.parent == key.parent == Path(CONTAINER_TLS_DIR)
    (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == str(cert.parent)]
    assert mount["readOnly"] is True
    assert "subPath" not in mount  # a subPath mount would never see the Secret change
    spec = pod_spec(envoy)
    (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    secret = find(docs, "Secret", volume["secret"]["secretName"])
    assert secret["type"] == "kubernetes.io/tls"
    assert set(secret["stringData"]) == {cert.name, key.name} == {"tls.crt", "tls.key"}
    assert volume["secret"]["defaultMode"] & 0o007 == 0  # not world-readable
    assert spec["securityContext"]["fsGroup"] == spec["securityContext"]["runAsGroup"]
    svc = find(docs, "Service", "envoy")
    (public,) = svc["spec"]["ports"]
    assert (public["port"], public["targetPort"]) == (443, "public")
    assert "h2c" not in str(public.get("appProtocol", ""))  # TLS, not cleartext HTTP/2


def test_services_select_existing_pods_and_ports(docs: list[Doc]) -> None:
    workloads = [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]
    for svc in (d for d in docs if d["kind"] == "Service"):
        selector = svc["spec"]["selector"]
        matches = [
            w
            for w in workloads
            if selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert len(matches) == 1, svc["metadata"]["name"]
        names = {p["name"] for c in pod_spec(matches[0])["containers"] for p in c["ports"]}
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in names


def test_referenced_configmaps_and_secrets_exist(docs: list[Doc]) -> None:
    """Every ConfigMap and Secret a pod mounts or reads a key of is in the manifests,
    and a key read from a Secret is one the Secret has."""
    seen = {"ConfigMap": 0, "Secret": 0, "secretKeyRef": 0}
    for w in (d for d in docs if d["kind"] in ("Deployment", "StatefulSet")):
        spec = pod_spec(w)
        for vol in spec.get("volumes", []):
            if "configMap" in vol:
                find(docs, "ConfigMap", vol["configMap"]["name"])
                seen["ConfigMap"] += 1
            if "secret" in vol:
                find(docs, "Secret", vol["secret"]["secretName"])
                seen["Secret"] += 1
        for c in spec["containers"] + spec.get("initContainers", []):
            for env in c.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    secret = find(docs, "Secret", ref["name"])
                    keys = {**secret.get("data", {}), **secret.get("stringData", {})}
                    assert ref["key"] in keys, f"{ref['name']} has no key {ref['key']}"
                    seen["secretKeyRef"] += 1
    assert all(seen.values()), f"the manifests no longer exercise every reference kind: {seen}"


def test_pods_run_as_non_root(docs: list[Doc]) -> None:
    for w in (d for d in docs if d["kind"] in ("Deployment", "StatefulSet")):
        spec = pod_spec(w)
        assert spec["securityContext"]["runAsNonRoot"] is True, w["metadata"]["name"]
        for c in spec["containers"] + spec.get("initContainers", []):
            assert c["securityContext"]["allowPrivilegeEscalation"] is False


def test_redis_has_an_acl_user_and_the_gateway_uses_it(docs: list[Doc]) -> None:
    """No anonymous Redis: the ACL the StatefulSet renders is common.redis_acl's, the
    password comes from one Secret that both Redis and the gateway mount."""
    redis = find(docs, "StatefulSet", "redis")
    script = " ".join(container(redis, "redis")["args"])
    prefix = RateLimitConfig().key_prefix
    assert "user default off" in script
    assert f"user {SERVICE_USER} on >%s {service_rules(prefix)}" in script
    assert "--aclfile" in script

    def secret_of(workload: Doc, c: Doc, path: Path) -> tuple[str, str]:
        (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == str(path.parent)]
        (volume,) = [v for v in pod_spec(workload)["volumes"] if v["name"] == mount["name"]]
        name = volume["secret"]["secretName"]
        assert path.name in find(docs, "Secret", name)["stringData"]
        return name, path.name

    password_path = Path(script.split("$(cat ", 1)[1].split(")", 1)[0])
    gateway = find(docs, "Deployment", "gateway")
    gw = container(gateway, "gateway")
    env = {e["name"]: e.get("value") for e in gw["env"]}
    assert env["LLM_RATELIMIT_REDIS_USERNAME"] == SERVICE_USER
    assert secret_of(gateway, gw, Path(env["LLM_RATELIMIT_REDIS_PASSWORD_FILE"])) == secret_of(
        redis, container(redis, "redis"), password_path
    )
    probe = " ".join(container(redis, "redis")["readinessProbe"]["exec"]["command"])
    assert f"--user {SERVICE_USER}" in probe
    assert "grep -q PONG" in probe


def _allowed(docs: list[Doc], src: dict[str, str] | None, dst: dict[str, str], port: int) -> bool:
    """Whether NetworkPolicies let a pod labelled ``src`` (None: outside the namespace)
    reach a pod labelled ``dst`` on ``port`` (the Kubernetes semantics, ingress only)."""
    policies = [
        d
        for d in docs
        if d["kind"] == "NetworkPolicy"
        and "Ingress" in d["spec"]["policyTypes"]
        and d["spec"]["podSelector"].get("matchLabels", {}).items() <= dst.items()
    ]
    if not policies:
        return True  # not isolated
    for pol in policies:
        for rule in pol["spec"].get("ingress", []):
            if "ports" in rule and port not in {p["port"] for p in rule["ports"]}:
                continue
            peers = rule.get("from")
            if peers is None:
                return True
            for peer in peers:
                if (
                    src is not None
                    and "podSelector" in peer
                    and "namespaceSelector" not in peer
                    and peer["podSelector"]["matchLabels"].items() <= src.items()
                ):
                    return True
    return False


def test_network_policies_allow_only_the_call_graph(docs: list[Doc]) -> None:
    apps = ["envoy", "gateway", "engine", "tokenizer", "redis"]
    labels = {
        a: {"app.kubernetes.io/name": a, "app.kubernetes.io/part-of": "llm-stack"} for a in apps
    }
    ports = {
        "envoy": [8080, 9901, 9902],
        "gateway": [50051, 8000, 9451],
        "engine": [50071, 9471],
        "tokenizer": [50061, 9461],
        "redis": [6379],
    }
    expected = {
        ("envoy", "gateway", 50051),
        ("envoy", "gateway", 8000),
        ("gateway", "engine", 50071),
        ("gateway", "tokenizer", 50061),
        ("gateway", "redis", 6379),
    }
    for dst in apps:
        for port in ports[dst]:
            outside = _allowed(docs, None, labels[dst], port)
            assert outside == (dst == "envoy" and port == 8080), (dst, port)
            for src in apps:
                if src != dst:
                    allowed = _allowed(docs, labels[src], labels[dst], port)
                    assert allowed == ((src, dst, port) in expected or outside), (src, dst, port)
    kinds = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "NetworkPolicy"}
    assert kinds["default-deny-ingress"] == {"podSelector": {}, "policyTypes": ["Ingress"]}
    backends = kinds["no-egress-for-backends"]
    assert backends["egress"] == []
    selected = set(backends["podSelector"]["matchExpressions"][0]["values"])
    assert selected == {"engine", "tokenizer", "redis"}


def test_engine_and_tokenizer_mount_one_model_image_and_convert_nothing(docs: list[Doc]) -> None:
    """The model is an image layer (deploy/docker/model.Dockerfile) mounted read-only where
    the ConfigMap's model_dir points, the same image for the engines and the tokenizer;
    no pod prepares or copies a model at start."""
    stack = yaml.safe_load(find(docs, "ConfigMap", "llm-stack-config")["data"]["stack.yaml"])
    model_dirs = {
        "engine": stack["engine_core"]["model_dir"],
        "tokenizer": stack["tokenizer"]["model_dir"],
    }
    assert stack["tokenizer"]["model_name"] == stack["engine"]["model_name"]
    images = set()
    for name, model_dir in model_dirs.items():
        spec = pod_spec(find(docs, "Deployment", name))
        (volume,) = [v for v in spec["volumes"] if "image" in v]
        images.add(volume["image"]["reference"])
        (mount,) = [
            m
            for m in container(find(docs, "Deployment", name), name)["volumeMounts"]
            if m["name"] == volume["name"]
        ]
        assert mount == {"name": volume["name"], "mountPath": model_dir, "readOnly": True}
        assert "initContainers" not in spec
    assert images == {"llm-stack/model:latest"}
    for doc in docs:
        assert "prepare_model" not in yaml.safe_dump(doc), doc["metadata"]["name"]
