"""Dockerfiles and deploy/compose.yaml, checked by structure (no Docker engine here)."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from common.config import ROOT
from common.redis_acl import SERVICE_USER, service_rules
from deploy.envoy.config import CONTAINER_PRESET, CONTAINER_TLS_DIR, render_config, tls_context
from ratelimit.config import RateLimitConfig
from tests.unit.deploy.helpers import (
    DEPLOY,
    ENVOY_PUBLIC_PORT,
    ENVOY_STATS_PORT,
    HEALTH_SERVICE,
    service_ports,
)

DOCKER = DEPLOY / "docker"
DOCKERFILES = sorted(DOCKER.glob("*.Dockerfile"))
MODULE_OF = {
    "tokenizer": "tokenizer_svc",
    "engine": "engine_svc",
    "gateway": "gateway",
}


@dataclass
class Stage:
    base: str
    name: str = ""  # FROM ... AS name
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, op: str) -> list[str]:
        return [arg for o, arg in self.instructions if o == op]


def parse_dockerfile(path: Path) -> tuple[dict[str, str], list[Stage]]:
    """Global ARG defaults and the stages, with line continuations joined."""
    text = re.sub(r"\\\n", " ", path.read_text())
    args: dict[str, str] = {}
    stages: list[Stage] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        op, _, rest = line.partition(" ")
        op = op.upper()
        if op == "FROM":
            base, *alias = rest.split()
            base = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), m.group(0)), base)
            stages.append(Stage(base, alias[1] if len(alias) == 2 else ""))
        elif stages:
            stages[-1].instructions.append((op, rest.strip()))
        elif op == "ARG" and "=" in rest:
            key, _, value = rest.partition("=")
            args[key.strip()] = value.strip()
    return args, stages


def test_there_is_a_dockerfile_per_service() -> None:
    names = {p.name.removesuffix(".Dockerfile") for p in DOCKERFILES}
    # model: a checkpoint as an image layer (data only), the services' images the rest
    assert names == {"tokenizer", "engine", "trtllm-serve", "gateway", "envoy", "model"}


SERVICE_DOCKERFILES = [p for p in DOCKERFILES if p.name != "model.Dockerfile"]


def test_the_model_image_is_a_checkpoint_and_nothing_else() -> None:
    """No process runs from it (FROM scratch): pods mount it as a read-only volume."""
    args, stages = parse_dockerfile(DOCKER / "model.Dockerfile")
    by_name = {s.name: s for s in stages}
    assert by_name["checkpoint"].base == by_name["smollm2"].base == "scratch"
    assert by_name["checkpoint"].all("COPY") == [". /"]  # the build context: your checkpoint
    assert stages[-1].name == "smollm2"  # the default target
    assert stages[-1].all("COPY") == ["--from=convert /tmp/model /"]
    assert by_name["convert"].base == args["ENGINE_IMAGE"] == "llm-stack/engine:latest"
    assert "engine_tools.prepare_model --model-dir /tmp/model" in by_name["convert"].all("RUN")[0]


@pytest.mark.parametrize("path", SERVICE_DOCKERFILES, ids=lambda p: p.name)
def test_final_stage_is_slim_non_root_and_health_checked(path: Path) -> None:
    _, stages = parse_dockerfile(path)
    final = stages[-1]
    name = path.name.removesuffix(".Dockerfile")
    if name == "envoy":
        assert re.fullmatch(r"envoyproxy/envoy:v1\.\d+\.\d+", final.base), final.base
    elif name == "trtllm-serve":  # NVIDIA's image as shipped; documented in the file
        assert final.base.startswith("nvcr.io/nvidia/tensorrt-llm/release:"), final.base
    else:
        assert re.fullmatch(r"python:3\.11-slim(-\w+)?", final.base), final.base
    users = final.all("USER")
    assert users, "the final stage must switch to a non-root user"
    assert users[-1].split(":")[0] not in ("0", "root")
    (health,) = final.all("HEALTHCHECK")
    assert "CMD" in health
    assert "--interval" in health
    assert "--start-period" in health
    assert not any(op == "ADD" for op, _ in final.instructions)


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_every_copied_source_exists(path: Path) -> None:
    _, stages = parse_dockerfile(path)
    for stage in stages:
        for arg in stage.all("COPY"):
            parts = [p for p in shlex.split(arg) if not p.startswith("--")]
            if any(p.startswith("--from") for p in shlex.split(arg)):
                continue
            for src in parts[:-1]:
                assert (ROOT / src).exists(), f"{path.name}: COPY {src} does not exist"


@pytest.mark.parametrize("name", ["tokenizer", "engine", "gateway"])
def test_python_images_run_their_service_on_the_configured_ports(name: str) -> None:
    _, stages = parse_dockerfile(DOCKER / f"{name}.Dockerfile")
    final = stages[-1]
    section = "engine" if name.startswith("engine") else name
    ports = service_ports(section)
    assert final.all("ENTRYPOINT") == [f'["python", "-m", "{MODULE_OF[name]}"]']
    exposed = {int(p) for arg in final.all("EXPOSE") for p in arg.split()}
    assert exposed == set(ports.values())  # gateway: + the OpenAI HTTP port
    env = " ".join(final.all("ENV"))
    prefix = f"LLM_{section.upper()}_"
    assert f"{prefix}PORT={ports['port']}" in env
    assert f"{prefix}METRICS_PORT={ports['metrics_port']}" in env
    assert f"{prefix}HOST=0.0.0.0" in env  # reachable from other containers
    (health,) = final.all("HEALTHCHECK")
    assert f"127.0.0.1:{ports['port']}" in health
    assert HEALTH_SERVICE[section] in health


def test_envoy_image_renders_the_one_config_and_keeps_admin_inside() -> None:
    _, stages = parse_dockerfile(DOCKER / "envoy.Dockerfile")
    build = " ".join(stages[0].all("RUN"))
    assert "python -m deploy.envoy.config --preset container" in build
    assert "gen_protos.py" in build
    final = stages[-1]
    exposed = {int(p) for arg in final.all("EXPOSE") for p in arg.split()}
    assert exposed == {ENVOY_PUBLIC_PORT, ENVOY_STATS_PORT}  # never the admin port


# --- compose ---------------------------------------------------------------


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    doc = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    assert isinstance(doc, dict)
    return doc


def env_of(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    return {str(k): str(v) for k, v in env.items()}


def test_every_long_running_service_has_a_healthcheck(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert {"redis", "tokenizer", "engine", "gateway", "envoy"} <= set(services)
    for name, svc in services.items():
        if svc.get("restart") == "no":  # one-shot init steps
            continue
        test = svc.get("healthcheck", {}).get("test")
        assert test, f"{name} has no healthcheck"
        assert test[0] in ("CMD", "CMD-SHELL"), f"{name}: healthcheck must run a command"


def test_compose_ports_match_the_config(compose: dict[str, Any]) -> None:
    services = compose["services"]
    for name in ("tokenizer", "engine", "gateway"):
        ports = service_ports(name)
        env = env_of(services[name])
        prefix = f"LLM_{name.upper()}_"
        assert int(env[prefix + "PORT"]) == ports["port"]
        assert int(env[prefix + "METRICS_PORT"]) == ports["metrics_port"]
        assert {int(p) for p in services[name]["expose"]} == set(ports.values())
        health = services[name]["healthcheck"]["test"]
        assert f"127.0.0.1:{ports['port']}" in health
        assert HEALTH_SERVICE[name] in health
    gw = env_of(services["gateway"])
    assert gw["LLM_GATEWAY_TOKENIZER"] == f"tokenizer:{service_ports('tokenizer')['port']}"
    assert gw["LLM_GATEWAY_ENGINES"] == f"engine:{service_ports('engine')['port']}"
    assert gw["LLM_RATELIMIT_REDIS_URL"].startswith("redis://redis:6379/")


def test_only_envoy_publishes_ports_besides_monitoring(compose: dict[str, Any]) -> None:
    published = {
        n
        for n, s in compose["services"].items()
        if s.get("ports") and "monitoring" not in s.get("profiles", [])
    }
    assert published == {"envoy"}
    ports = compose["services"]["envoy"]["ports"]
    assert f"{ENVOY_PUBLIC_PORT}:{ENVOY_PUBLIC_PORT}" in ports
    assert not any(p.endswith(":9901") for p in ports)


def test_compose_references_resolve(compose: dict[str, Any]) -> None:
    services = compose["services"]
    volumes = set(compose.get("volumes", {}))
    for name, svc in services.items():
        for dep in svc.get("depends_on", {}):
            assert dep in services, f"{name} depends on unknown {dep}"
        if "build" in svc:
            assert (DEPLOY / svc["build"]["context"] / svc["build"]["dockerfile"]).exists()
        else:
            image = svc["image"]
            assert "/" in image or ":" in image
        for vol in svc.get("volumes", []):
            src = vol["source"] if isinstance(vol, dict) else vol.split(":/")[0]
            default = re.fullmatch(r"\$\{\w+:-([\w-]+)\}", src)
            if default:  # a host path the operator may name, else a declared volume
                assert default.group(1) in volumes, f"{name}: volume {src} not declared"
            elif src.startswith("${"):  # a host path the operator names
                assert ":?" in src, f"{name}: {src} must be required, not defaulted"
            elif src.startswith("."):
                assert (DEPLOY / src).exists(), f"{name}: {src} missing"
            else:
                assert src in volumes, f"{name}: volume {src} not declared"
    # images used without a build section are built by another service
    built = {s["image"] for s in services.values() if "build" in s}
    for svc in services.values():
        if "build" not in svc and svc["image"].startswith("llm-stack/"):
            assert svc["image"] in built


def test_gateway_waits_for_its_dependencies_and_scales(compose: dict[str, Any]) -> None:
    gw = compose["services"]["gateway"]
    assert {k: v["condition"] for k, v in gw["depends_on"].items()} == {
        "redis": "service_healthy",
        "tokenizer": "service_healthy",
        "engine": "service_healthy",
    }
    assert gw["deploy"]["replicas"] >= 2
    assert "ADMIN_KEY" in env_of(gw)
    model_users = [n for n, s in compose["services"].items() if "model" in s.get("depends_on", {})]
    for name in model_users:
        dep = compose["services"][name]["depends_on"]["model"]
        assert dep["condition"] == "service_completed_successfully"


def test_internal_services_share_the_service_token_secret(compose: dict[str, Any]) -> None:
    """Engine and tokenizer require the secret; the gateway sends it: one compose secret."""
    name = "service_token"
    assert compose["secrets"][name] == {"environment": "SERVICE_TOKEN"}
    for svc, section in (("engine", "ENGINE"), ("tokenizer", "TOKENIZER"), ("gateway", "GATEWAY")):
        spec = compose["services"][svc]
        assert name in spec["secrets"], svc
        assert env_of(spec)[f"LLM_{section}_SERVICE_TOKEN_FILE"] == f"/run/secrets/{name}"


def test_redis_has_an_acl_user_and_the_gateway_uses_it(compose: dict[str, Any]) -> None:
    """No anonymous Redis: common.redis_acl's rules, the password a compose secret."""
    assert compose["secrets"]["redis_password"] == {"environment": "REDIS_PASSWORD"}
    redis = compose["services"]["redis"]
    script = " ".join(redis["command"])
    assert "user default off" in script
    assert "--aclfile" in script
    assert f"user {SERVICE_USER} on >%s {service_rules(RateLimitConfig().key_prefix)}" in script
    assert "$$(cat /run/secrets/redis_password)" in script
    assert "redis_password" in redis["secrets"]
    assert f"--user {SERVICE_USER}" in redis["healthcheck"]["test"][1]
    gateway = compose["services"]["gateway"]
    assert "redis_password" in gateway["secrets"]
    env = env_of(gateway)
    assert env["LLM_RATELIMIT_REDIS_USERNAME"] == SERVICE_USER
    assert env["LLM_RATELIMIT_REDIS_PASSWORD_FILE"] == "/run/secrets/redis_password"


def test_envoy_mounts_the_tls_directory_its_config_reads(compose: dict[str, Any]) -> None:
    """The image's config names /etc/envoy/tls/tls.{crt,key}; compose mounts a host
    directory there, read-only, and refuses to start without one."""
    (mount,) = [v for v in compose["services"]["envoy"]["volumes"] if isinstance(v, dict)]
    assert mount["type"] == "bind"
    assert mount["target"] == CONTAINER_TLS_DIR
    assert mount["read_only"] is True
    assert mount["source"].startswith("${TLS_DIR:?")
    for key in ("tls_cert", "tls_key"):
        assert Path(CONTAINER_PRESET[key]).parent == Path(mount["target"])
    cfg = render_config(**CONTAINER_PRESET)
    (certificate,) = tls_context(cfg)["common_tls_context"]["tls_certificates"]
    assert certificate["certificate_chain"]["filename"] == f"{CONTAINER_TLS_DIR}/tls.crt"
    assert certificate["private_key"]["filename"] == f"{CONTAINER_TLS_DIR}/tls.key"


def test_engine_and_tokenizer_serve_one_model_from_one_source(compose: dict[str, Any]) -> None:
    """MODELS (a host directory of checkpoints) replaces the "models" volume and
    MODEL_NAME picks one: the engine and the tokenizer load the same directory and
    serve it under the same name, SmolLM2 from the volume when neither is set."""
    services = compose["services"]
    model_dir = "/models/${MODEL_NAME:-SmolLM2-135M-Instruct}"
    for name in ("engine", "tokenizer"):
        env = env_of(services[name])
        assert services[name]["volumes"] == ["${MODELS:-models}:/models:ro"]
        assert env["LLM_MODEL_DIR"] == model_dir
        assert env[f"LLM_{name.upper()}_MODEL_NAME"] == "${MODEL_NAME:-SmolLM2-135M-Instruct}"
    model = services["model"]  # the default's one-shot conversion, into the volume
    assert model["volumes"] == ["models:/models"]
    assert model["command"] == ["--model-dir", "/models/SmolLM2-135M-Instruct"]
