"""Each Python image runs from exactly what its Dockerfile copies (no container engine here).

The test lays out ``/app`` the way the Dockerfile's build stage copies it (plus the
generated ``llm`` package its ``gen_protos.py`` step writes), hides the repository
and the editable install from the interpreter, blocks the packages the image must
not need (torch and the model-preparation stack for the gateway and the tokenizer),
and starts the entrypoint with the environment deploy/compose.yaml gives the
service. Only the addresses, ports and secrets are pointed at this test's loopback
servers. The gateway gets no model directory at all (compose mounts none into it)
and still serves a completion: its tokenizer comes from the engine.
"""

from __future__ import annotations

import secrets
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from common.config import ROOT
from common.procs import ManagedProcess
from common.redis_server import RedisServer
from common.service_auth import SERVICE_TOKEN_KEY
from llm.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    common_pb2,
    gateway_pb2,
    gateway_pb2_grpc,
    tokenizer_pb2,
    tokenizer_pb2_grpc,
)
from tests.unit.deploy.helpers import DEPLOY
from tests.unit.deploy.test_docker_compose import DOCKER, parse_dockerfile
from tokenizer_svc.tokenizer import TextTokenizer

pytestmark = pytest.mark.integration

# What an image must run without (its Dockerfile does not install it).
NOT_IN_IMAGE = {
    "gateway": ["torch", "safetensors", "transformers", "gguf", "accelerate"],
    "tokenizer": ["torch", "safetensors", "transformers", "gguf", "accelerate"],
    "engine": [],
}

LAUNCHER = '''
"""Run a module from an image layout: the repository and the editable install hidden."""
import runpy, sys
from pathlib import Path

app, repo, venv, blocked, module = sys.argv[1:6]
inside = lambda p, d: Path(p).resolve().is_relative_to(Path(d).resolve())
editable = lambda x: "__editable__" in str(getattr(x, "__module__", x))
sys.path[:] = [app] + [
    p for p in sys.path[1:] if p and not editable(p) and (not inside(p, repo) or inside(p, venv))
]
sys.meta_path[:] = [f for f in sys.meta_path if not editable(f)]
hooks = sys.path_hooks
hooks[:] = [h for h in hooks if not editable(h)]
sys.path_importer_cache.clear()
for name in filter(None, blocked.split(",")):
    sys.modules[name] = None  # import raises ImportError
sys.argv = [module, *sys.argv[6:]]
runpy.run_module(module, run_name="__main__", alter_sys=True)
'''


def build_context(name: str) -> list[str]:
    """What the image's .dockerignore lets into the build context (it ignores ``**`` and
    lists the exceptions as ``!path`` or ``!dir/**``)."""
    lines = (DOCKER / f"{name}.Dockerfile.dockerignore").read_text().splitlines()
    assert "**" in lines, "the context must start from nothing"
    return [ln[1:].removesuffix("/**") for ln in lines if ln.startswith("!")]


def lay_out(name: str, root: Path) -> Path:
    """``/app`` of ``name``'s image under ``root``: the build stage's COPYs, and ``llm``."""
    _, stages = parse_dockerfile(DOCKER / f"{name}.Dockerfile")
    context = build_context(name)
    app = root / "app"
    app.mkdir(parents=True)
    for arg in stages[0].all("COPY"):
        *sources, target = shlex.split(arg)
        for src in sources:
            sent = any(src == c or src.startswith(c + "/") for c in context)
            assert sent, f"{name}.Dockerfile copies {src}, which its .dockerignore leaves out"
            dest = app / target / Path(src).name if target.endswith("/") else app / target
            if (ROOT / src).is_dir():
                shutil.copytree(ROOT / src, dest, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / src, dest)
    shutil.copytree(ROOT / "llm", app / "llm", ignore=shutil.ignore_patterns("__pycache__"))
    return app


def launcher(name: str, app: Path) -> list[str]:
    script = app.parent / "launch.py"
    script.write_text(LAUNCHER)
    venv = Path(sys.prefix)
    return [
        sys.executable,
        str(script),
        str(app),
        str(ROOT),
        str(venv),
        ",".join(NOT_IN_IMAGE[name]),
    ]


def image_process(
    image: str, module: str, app: Path, env: dict[str, str], tmp: Path
) -> ManagedProcess:
    """The image's entrypoint (``python -m module`` and the image's CMD) from its layout."""
    return ManagedProcess(
        name=f"{image}-image",
        module=module,
        args=["--log-format", "json"],
        env=env,
        log_dir=tmp / "logs",
        launcher=launcher(image, app),
        cwd=app,
    )


def compose_env(service: str, app: Path, replace: dict[str, str]) -> dict[str, str]:
    """The service's compose environment with /app at ``app`` and ``replace`` applied
    (addresses, ports and secret files of this test)."""
    doc: dict[str, Any] = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    env = {k: str(v) for k, v in doc["services"][service]["environment"].items()}
    env = {k: v.replace("/app/", f"{app}/") for k, v in env.items()}
    env.update(replace)
    env["PYTHONPATH"] = str(app)
    return env


@pytest.fixture(scope="module")
def redis() -> Iterator[RedisServer]:
    server = RedisServer().start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="module")
def token_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("secrets") / "service_token"
    path.write_text(secrets.token_urlsafe(32))
    return path


def test_the_engine_image_imports_its_entrypoint_backend_and_tools(tmp_path: Path) -> None:
    name, backend = "engine", "native"
    app = lay_out(name, tmp_path)
    # a probe module in the layout (the launcher runs modules): the entrypoint, the
    # backend (imported lazily by the entrypoint), the model preparation and the
    # renderer of trtllm-serve's options (the TensorRT-LLM pods' init container)
    (app / "image_probe.py").write_text(
        f"import engine_svc.__main__, engine_svc.backends.{backend}, engine_tools.prepare_model\n"
        "import deploy.trtllm_options\n"
        "import engine_svc\n"
        "print('imported from', engine_svc.__file__)\n"
    )
    proc = subprocess.run(
        [*launcher(name, app), "image_probe"],
        cwd=app,
        env={"PYTHONPATH": str(app), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"imported from {app}/engine_svc/__init__.py" in proc.stdout


def test_the_tokenizer_image_serves_from_the_mounted_model(
    tmp_path: Path, model_dir: Path, token_file: Path
) -> None:
    app = lay_out("tokenizer", tmp_path)
    env = compose_env(
        "tokenizer",
        app,
        {
            "LLM_MODEL_DIR": str(model_dir),  # the models volume
            "LLM_TOKENIZER_HOST": "127.0.0.1",
            "LLM_TOKENIZER_PORT": "0",
            "LLM_TOKENIZER_METRICS_PORT": "0",
            "LLM_TOKENIZER_SERVICE_TOKEN_FILE": str(token_file),
        },
    )
    proc = image_process("tokenizer", "tokenizer_svc", app, env, tmp_path)
    md = ((SERVICE_TOKEN_KEY, token_file.read_text()),)
    with proc, grpc.insecure_channel(proc.address) as ch:
        stub = tokenizer_pb2_grpc.TokenizerStub(ch)
        out = stub.Encode(tokenizer_pb2.EncodeRequest(text="Hello, image"), metadata=md)
        with pytest.raises(grpc.RpcError) as err:  # the mounted secret is enforced
            stub.Encode(tokenizer_pb2.EncodeRequest(text="Hello, image"))
    assert list(out.token_ids) == TextTokenizer(model_dir).encode("Hello, image")
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_the_gateway_image_serves_without_any_model_files(
    tmp_path: Path,
    engine_server: ManagedProcess,
    tokenizer_server: ManagedProcess,
    redis: RedisServer,
    token_file: Path,
) -> None:
    app = lay_out("gateway", tmp_path)
    assert not list(app.rglob("*.safetensors"))
    assert not list(app.rglob("tokenizer.json"))
    admin_key = "sk-llm-" + secrets.token_urlsafe(32)
    env = compose_env(
        "gateway",
        app,
        {
            "LLM_GATEWAY_HOST": "127.0.0.1",
            "LLM_GATEWAY_PORT": "0",
            "LLM_GATEWAY_METRICS_PORT": "0",
            "LLM_GATEWAY_HTTP_PORT": "0",
            "LLM_GATEWAY_TOKENIZER": tokenizer_server.address,
            "LLM_GATEWAY_ENGINES": engine_server.address,
            "LLM_RATELIMIT_REDIS_URL": redis.url,
            "LLM_RATELIMIT_NUM_REPLICAS": "1",
            "ADMIN_KEY": admin_key,
            "LLM_GATEWAY_SERVICE_TOKEN_FILE": str(token_file),
            # the test's Redis has no ACL user; compose's Redis does
            "LLM_RATELIMIT_REDIS_USERNAME": "",
            "LLM_RATELIMIT_REDIS_PASSWORD_FILE": "",
        },
    )
    assert env["LLM_MODEL_DIR"].startswith("/models/")  # what compose sets: not there
    assert not Path(env["LLM_MODEL_DIR"]).exists()
    proc = image_process("gateway", "gateway", app, env, tmp_path)
    with proc, grpc.insecure_channel(proc.address) as ch:
        admin_md = (("authorization", f"Bearer {admin_key}"),)
        admin = admin_pb2_grpc.RateLimitAdminStub(ch)
        admin.UpsertTenant(admin_pb2.Tenant(id="image-test"), metadata=admin_md)
        key = admin.CreateApiKey(
            admin_pb2.CreateApiKeyRequest(tenant_id="image-test", name="t"), metadata=admin_md
        ).key
        msgs = common_pb2.ChatMessages(messages=[common_pb2.ChatMessage(role="user", content="Hi")])
        req = gateway_pb2.GenerateRequest(
            messages=msgs, sampling=common_pb2.SamplingParams(max_tokens=3)
        )
        stream = gateway_pb2_grpc.GatewayStub(ch).Generate(
            req, metadata=(("authorization", f"Bearer {key}"),), timeout=120
        )
        chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == 3
    assert "".join(c.text for c in chunks)
