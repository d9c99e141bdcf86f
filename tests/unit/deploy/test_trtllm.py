"""TensorRT-LLM as the stock ``trtllm-serve --grpc``: the options renderer
(deploy/trtllm_options.py), the Kubernetes overlay deploy/k8s-trtllm, the compose
override deploy/compose.trtllm.yaml and the image, checked offline (no GPU, no
TensorRT-LLM, no container engine here).

The overlay is rendered (``tests.unit.deploy.kustomize``, compared with ``kubectl
kustomize`` where kubectl is installed), every object validated against the
Kubernetes schemas, and cross-checked: the pod's GPU request is the rendered
tensor x pipeline parallel, the server's arguments are the renderer's, the
gateways' engine entry parses with the gateway's own parser and names the Service
and port, and the NetworkPolicies let only the gateways reach the engine port
(trtllm-serve checks no key and speaks no TLS).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]  # no py.typed
import pytest
import yaml

from common.config import load_config
from deploy import trtllm_options
from deploy.trtllm_options import gpus, render_options, serve_args
from engine_svc.core.config import EngineConfig, SchedulerConfig
from gateway.config import parse_engine_entry
from tests.unit.deploy.helpers import DEPLOY, service_ports
from tests.unit.deploy.kustomize import render
from tests.unit.deploy.test_compose_redis_cluster import ComposeLoader, compose_merge
from tests.unit.deploy.test_docker_compose import DOCKER, parse_dockerfile
from tests.unit.deploy.test_k8s import VERSION, _allowed, container, find, pod_spec

OVERLAY = DEPLOY / "k8s-trtllm"
Doc = dict[str, Any]
GPU = "nvidia.com/gpu"


# --- the renderer ------------------------------------------------------------


def test_the_options_carry_fp8_kv_chunked_prefill_and_the_batch_limits() -> None:
    core = EngineConfig(
        kv_cache_dtype="fp8",
        kv_cache_memory_fraction=0.8,
        enable_prefix_caching=False,
        max_model_len=4096,
        scheduler=SchedulerConfig(max_num_seqs=96, max_num_batched_tokens=4096),
        tensor_parallel_size=2,
        pipeline_parallel_size=3,
    )
    options = render_options(core)
    assert options["enable_chunked_prefill"] is True
    assert options["kv_cache_config"] == {
        "dtype": "fp8",
        "free_gpu_memory_fraction": 0.8,
        "enable_block_reuse": False,
    }
    assert (options["max_batch_size"], options["max_num_tokens"]) == (96, 4096)
    assert options["max_seq_len"] == 4096
    assert (options["tensor_parallel_size"], options["pipeline_parallel_size"]) == (2, 3)
    assert gpus(core) == 6
    # the model's own context length unless the config caps it
    assert "max_seq_len" not in render_options(EngineConfig())


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("kv_cache_dtype", "bfloat16", "kv_cache_dtype"),
        ("tensor_parallel_size", 0, "tensor_parallel_size"),
        ("pipeline_parallel_size", -1, "pipeline_parallel_size"),
        ("kv_cache_memory_fraction", 0.0, "kv_cache_memory_fraction"),
    ],
)
def test_what_trtllm_serve_cannot_take_is_refused_naming_the_key(
    field: str, value: Any, named: str
) -> None:
    with pytest.raises(ValueError, match=named):
        render_options(EngineConfig(**{field: value}))


def test_the_command_writes_the_file_and_refuses_a_gpu_count_that_is_not_tp_x_pp(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "stack.yaml"
    config.write_text(
        "engine_core:\n  kv_cache_dtype: fp8\n  tensor_parallel_size: 2\n"
        "  pipeline_parallel_size: 2\n"
    )
    out = tmp_path / "run" / "options.yaml"
    assert (
        trtllm_options.main(["--config", str(config), "--out", str(out), "--expect-gpus", "4"]) == 0
    )
    written = yaml.safe_load(out.read_text())
    assert written["kv_cache_config"]["dtype"] == "fp8"
    assert written["tensor_parallel_size"] * written["pipeline_parallel_size"] == 4
    out.unlink()
    assert (
        trtllm_options.main(["--config", str(config), "--out", str(out), "--expect-gpus", "2"]) == 2
    )
    assert "2 GPU(s) reserved" in capsys.readouterr().out
    assert not out.exists()
    assert trtllm_options.main(["--config", str(config), "--print-gpus"]) == 0
    assert capsys.readouterr().out.strip() == "4"


# --- the Kubernetes overlay ----------------------------------------------------


@pytest.fixture(scope="module")
def docs() -> list[Doc]:
    return render(OVERLAY)


def overlay_core(docs: list[Doc], tmp_path: Path) -> EngineConfig:
    stack = tmp_path / "stack.yaml"
    stack.write_text(find(docs, "ConfigMap", "llm-trtllm-config")["data"]["stack.yaml"])
    return load_config(EngineConfig, "engine_core", path=stack, env={})


def test_the_python_rendering_is_kubectls() -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("no kubectl here; the Python rendering is checked by the other tests")
    out = subprocess.run(
        [kubectl, "kustomize", str(OVERLAY)], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    theirs = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(out) if d}
    assert theirs == {(d["kind"], d["metadata"]["name"]): d for d in render(OVERLAY)}


def test_every_object_is_valid_and_trtllm_serve_replaces_the_native_engine(
    docs: list[Doc],
) -> None:
    for d in docs:
        kubernetes_validate.validate(d, VERSION, strict=True)
        assert d["metadata"].get("namespace", "llm-stack") == "llm-stack"
    names = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert ("Deployment", "engine") not in names
    assert ("HorizontalPodAutoscaler", "engine") not in names  # nothing to scale on
    assert {("Deployment", "trtllm-engine"), ("Service", "engine")} <= names
    # the base's Service, PDB and NetworkPolicy select the new pods
    labels = find(docs, "Deployment", "trtllm-engine")["spec"]["template"]["metadata"]["labels"]
    for kind, name in [("Service", "engine"), ("PodDisruptionBudget", "engine")]:
        spec = find(docs, kind, name)["spec"]
        selector = spec["selector"].get("matchLabels", spec["selector"])
        assert selector.items() <= labels.items(), (kind, name)
    workloads = [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]
    assert all(d["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] for d in workloads)


def test_the_gpu_request_is_tensor_times_pipeline_parallel(docs: list[Doc], tmp_path: Path) -> None:
    core = overlay_core(docs, tmp_path)
    engine = find(docs, "Deployment", "trtllm-engine")
    c = container(engine, "trtllm-serve")
    wanted = str(gpus(core))
    assert c["resources"]["requests"][GPU] == c["resources"]["limits"][GPU] == wanted
    # the init container that quantizes on the GPUs asks for the same ones
    (quantize,) = [i for i in pod_spec(engine)["initContainers"] if i["name"] == "quantize-fp8"]
    assert quantize["resources"]["limits"][GPU] == wanted
    assert any(t["key"] == GPU for t in pod_spec(engine)["tolerations"])
    # and the test can fail: a 2 x 2 config would not fit this pod
    bigger = EngineConfig(tensor_parallel_size=2, pipeline_parallel_size=2)
    assert str(gpus(bigger)) != c["resources"]["limits"][GPU]


def test_the_server_runs_the_renderers_arguments_on_the_rendered_options(
    docs: list[Doc], tmp_path: Path
) -> None:
    core = overlay_core(docs, tmp_path)
    assert core.kv_cache_dtype == "fp8"
    options = render_options(core)  # renders: the init container would not fail
    assert options["enable_chunked_prefill"] is True
    engine = find(docs, "Deployment", "trtllm-engine")
    c = container(engine, "trtllm-serve")
    port = service_ports("engine")["port"]
    assert c["command"] == ["trtllm-serve"]
    assert c["args"] == serve_args(core.model_dir, port)
    assert {"name": "grpc", "containerPort": port} in c["ports"]
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert c[probe]["tcpSocket"] == {"port": "grpc"}, probe
    inits = {i["name"]: i for i in pod_spec(engine)["initContainers"]}
    assert list(inits) == ["quantize-fp8", "render-options"]  # in this order
    render_cmd = inits["render-options"]["command"]
    config_mount = next(
        m for m in inits["render-options"]["volumeMounts"] if m["name"] == "trtllm-config"
    )
    assert render_cmd[render_cmd.index("--config") + 1] == f"{config_mount['mountPath']}/stack.yaml"
    out = render_cmd[render_cmd.index("--out") + 1]
    assert out == trtllm_options.OPTIONS_PATH
    quantize = inits["quantize-fp8"]["command"]
    assert quantize[quantize.index("--out") + 1] == core.model_dir  # the FP8 export is served
    # of the model image's checkpoint, as the base mounts it (no per-pod conversion)
    (image,) = [v for v in pod_spec(engine)["volumes"] if "image" in v]
    assert image["image"]["reference"] == "llm-stack/model:latest"
    (mount,) = [m for m in inits["quantize-fp8"]["volumeMounts"] if m["name"] == image["name"]]
    assert quantize[quantize.index("--model") + 1] == mount["mountPath"]
    # the options file reaches the server through a volume both mount
    (options_mount,) = [m for m in c["volumeMounts"] if m["name"] == "trtllm-options"]
    assert Path(out).parent == Path(options_mount["mountPath"])


def test_the_gateways_speak_trtllm_service_to_the_engine_service(docs: list[Doc]) -> None:
    gw = container(find(docs, "Deployment", "gateway"), "gateway")
    env = {e["name"]: e.get("value") for e in gw["env"]}
    entry = parse_engine_entry(env["LLM_GATEWAY_ENGINES"])
    svc = find(docs, "Service", "engine")
    assert (entry.protocol, entry.host) == ("trtllm", "engine")
    assert entry.port == svc["spec"]["ports"][0]["port"]
    assert svc["spec"]["clusterIP"] == "None"  # every pod, balanced by the gateway


def test_only_the_gateways_reach_the_unauthenticated_engine_port(docs: list[Doc]) -> None:
    port = service_ports("engine")["port"]
    labels = find(docs, "Deployment", "trtllm-engine")["spec"]["template"]["metadata"]["labels"]
    app = {"app.kubernetes.io/part-of": "llm-stack"}
    assert _allowed(docs, {**app, "app.kubernetes.io/name": "gateway"}, labels, port)
    for other in ("envoy", "tokenizer", "redis", "anything"):
        assert not _allowed(docs, {**app, "app.kubernetes.io/name": other}, labels, port), other
    assert not _allowed(docs, None, labels, port)  # nothing from outside the namespace
    backends = find(docs, "NetworkPolicy", "no-egress-for-backends")["spec"]
    assert "engine" in backends["podSelector"]["matchExpressions"][0]["values"]


# --- compose and the image -------------------------------------------------------


@pytest.fixture(scope="module")
def merged() -> dict[str, Any]:
    base = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    override = yaml.load(  # a SafeLoader that also knows !override
        (DEPLOY / "compose.trtllm.yaml").read_text(), Loader=ComposeLoader
    )
    out: dict[str, Any] = compose_merge(base, override)
    return out


def test_compose_runs_trtllm_serve_on_rendered_options_behind_the_gateway(
    merged: dict[str, Any],
) -> None:
    from tests.unit.deploy import test_docker_compose as base_checks

    base_checks.test_every_long_running_service_has_a_healthcheck(merged)
    base_checks.test_only_envoy_publishes_ports_besides_monitoring(merged)
    services = merged["services"]
    assert services["engine"]["profiles"] == ["native-engine"]  # nobody starts it
    server = services["engine-trtllm"]
    port = service_ports("engine")["port"]
    assert server["command"] == serve_args("/models/SmolLM2-135M-Instruct-FP8", port)
    (devices,) = server["deploy"]["resources"]["reservations"]["devices"]
    assert devices["count"] == "${TRTLLM_GPUS:-1}"
    opts = services["trtllm-options"]
    # the renderer refuses when the reservation is not tp x pp: both from the same variables
    cmd = opts["command"]
    assert cmd[cmd.index("--expect-gpus") + 1] == devices["count"]
    env = opts["environment"]
    assert env["LLM_ENGINE_CORE_TENSOR_PARALLEL_SIZE"] == "${TRTLLM_TP:-1}"
    assert env["LLM_ENGINE_CORE_PIPELINE_PARALLEL_SIZE"] == "${TRTLLM_PP:-1}"
    defaults = {
        k: v.replace("${TRTLLM_TP:-1}", "1").replace("${TRTLLM_PP:-1}", "1") for k, v in env.items()
    }
    core = load_config(EngineConfig, "engine_core", env=defaults)
    assert gpus(core) == 1
    assert core.model_dir == server["command"][0]
    assert render_options(core)["kv_cache_config"]["dtype"] == "fp8"
    gw = services["gateway"]
    entry = parse_engine_entry(gw["environment"]["LLM_GATEWAY_ENGINES"])
    assert (entry.protocol, entry.host, entry.port) == ("trtllm", "engine-trtllm", port)
    assert set(gw["depends_on"]) == {"redis", "tokenizer", "engine-trtllm"}
    assert "ports" not in server  # reached on the compose network only


def test_the_image_is_nvidias_with_the_stock_server_as_entrypoint() -> None:
    args, stages = parse_dockerfile(DOCKER / "trtllm-serve.Dockerfile")
    assert args["TRTLLM_IMAGE"].startswith("nvcr.io/nvidia/tensorrt-llm/release:")
    (final,) = stages
    assert final.all("ENTRYPOINT") == ['["trtllm-serve"]']
    exposed = {int(p) for arg in final.all("EXPOSE") for p in arg.split()}
    assert exposed == {service_ports("engine")["port"]}
    run = " ".join(final.all("RUN"))
    assert "smg-grpc-proto==" in run
    assert "--no-deps" in run  # NVIDIA's grpcio and protobuf stay
    copies = " ".join(final.all("COPY"))
    assert "deploy/quantize_fp8.py /opt/llm/quantize_fp8.py" in copies
