"""`python -m engine_svc`: serve llm.v1.Engine (config sections `engine`, `engine_core`).

    python -m engine_svc [--port 50071] [--model-dir DIR] ...

Health stays NOT_SERVING until a real warm-up batch has run. SIGTERM drains:
new requests get UNAVAILABLE, in-flight streams get ``grace_seconds`` to
finish, the rest are cancelled (their KV blocks freed), then the step-loop
thread stops and the process exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hashlib
import json
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path

import grpc

from common.config import (
    ROOT,
    add_service_args,
    default_model_dir,
    load_config,
    service_overrides,
)
from common.log import configure_logging, get_logger
from common.server import ServiceHooks, run, run_service
from common.service_auth import read_server_tls
from engine_svc import metrics
from engine_svc.backends.base import Backend, GenerateInput
from engine_svc.config import EngineServiceConfig
from engine_svc.core.config import EngineConfig
from engine_svc.core.outputs import RequestOutput
from engine_svc.core.sampling_params import SamplingParams
from engine_svc.service import EngineServicer
from engine_svc.standard.serve import standard_servicers
from llm.v1 import engine_pb2, engine_pb2_grpc
from tokenizer_svc.tokenizer import read_tokenizer_files

log = get_logger("engine_svc")


def model_version(model_dir: Path) -> str:
    """``sha-<first 12 hex of model.safetensors' SHA-256>`` from the prepare manifest."""
    try:
        manifest = json.loads((model_dir / "manifest.json").read_text())
        return "sha-" + str(manifest["files"]["model.safetensors"])[:12]
    except (FileNotFoundError, KeyError, json.JSONDecodeError):
        return "unversioned"


def tokenizer_files(model_dir: Path) -> dict[str, bytes]:
    """The model's tokenizer files for GetTokenizer; none (logged) if it has no tokenizer."""
    try:
        return read_tokenizer_files(model_dir)
    except FileNotFoundError as e:
        log.warning("serving no tokenizer", reason=str(e))
        return {}


def config_hash(*configs: object) -> str:
    blob = json.dumps([dataclasses.asdict(c) for c in configs], sort_keys=True)  # type: ignore[call-overload]
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def engine_build() -> str:
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=ROOT,
            text=True,
            capture_output=True,
            timeout=5,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        rev = "unknown"
    return f"llm-serving-stack 0.1.0 git {rev}"


def make_backend(svc: EngineServiceConfig, core: EngineConfig) -> Backend:
    """The native backend (``engine.backend`` allows no other: EngineServiceConfig)."""
    from engine_svc.backends.native import NativeBackend
    from engine_svc.core.llm_engine import LLMEngine

    return NativeBackend(lambda: LLMEngine(core))


async def warm_up(backend: Backend) -> None:
    """Run one real batch (up to two short requests together) before reporting SERVING."""
    params = SamplingParams(max_tokens=4)
    s = backend.stats().engine
    n = max(1, min(2, s.max_num_seqs, s.max_waiting))
    streams = [
        backend.generate(GenerateInput(f"warmup-{i}", [1, 2, 3, 4 + i], params)) for i in range(n)
    ]

    async def drain(s: AsyncIterator[RequestOutput]) -> int:
        return sum([len(o.new_token_ids) async for o in s])

    tokens = await asyncio.gather(*(drain(s) for s in streams))
    log.info("warm-up batch done", tokens=sum(tokens))


def main(
    argv: Sequence[str] | None = None,
    backend_factory: Callable[[EngineServiceConfig, EngineConfig], Backend] = make_backend,
) -> None:
    """Serve until SIGTERM. ``backend_factory`` builds the backend from the configs (the
    benches swap in a no-compute one to time everything but the model)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m engine_svc", description=__doc__)
    add_service_args(parser)
    parser.add_argument(
        "--backend",
        help="native, the only one (vLLM runs as its stock gRPC server: docs/engines.md)",
    )
    parser.add_argument("--model-dir")
    parser.add_argument("--model-version")
    parser.add_argument("--num-kv-blocks", type=int)
    parser.add_argument("--max-num-seqs", type=int)
    parser.add_argument("--tls-cert-file", help="PEM server certificate: the port is TLS")
    parser.add_argument("--tls-key-file", help="PEM key of --tls-cert-file")
    parser.add_argument(
        "--tls-client-ca-file", help="PEM CA of the client certificates required (mutual TLS)"
    )
    args = parser.parse_args(argv)
    svc = load_config(
        EngineServiceConfig,
        "engine",
        path=args.config,
        overrides={
            **service_overrides(args),
            "backend": args.backend,
            "model_version": args.model_version,
            "tls_cert_file": args.tls_cert_file,
            "tls_key_file": args.tls_key_file,
            "tls_client_ca_file": args.tls_client_ca_file,
        },
    )
    core = load_config(
        EngineConfig,
        "engine_core",
        path=args.config,
        overrides={
            "model_dir": args.model_dir,
            "num_kv_blocks": args.num_kv_blocks,
            "scheduler.max_num_seqs": args.max_num_seqs,
        },
    )
    configure_logging("engine", svc.log_level, svc.log_format)
    model_dir = Path(core.model_dir or default_model_dir())
    core.model_dir = str(model_dir)
    version = svc.model_version or model_version(model_dir)
    backend = backend_factory(svc, core)
    servicer = EngineServicer(
        backend,
        model_name=svc.model_name,
        version=version,
        config_hash=config_hash(svc, core),
        build=engine_build(),
        tokenizer_files=tokenizer_files(model_dir),
    )

    standard = standard_servicers(backend, servicer, svc, model_dir, version, engine_build())

    def register(server: grpc.aio.Server) -> list[str]:
        engine_pb2_grpc.add_EngineServicer_to_server(servicer, server)
        return [
            engine_pb2.DESCRIPTOR.services_by_name["Engine"].full_name,
            *standard.register(server),
        ]

    async def ready() -> None:
        await backend.start()
        metrics.register_stats(backend.stats)
        info = backend.model_info()
        metrics.export(svc.model_name, info.max_context_length)
        metrics.MODEL.info(
            {
                "model": svc.model_name,
                "version": version,
                "backend": svc.backend,
                "config_hash": config_hash(svc, core),
                "build": engine_build(),
                "weight_dtype": info.weight_dtype,
                "kv_cache_dtype": info.kv_cache_dtype,
                "compute": info.compute,
            }
        )
        log.info(
            "engine started",
            backend=svc.backend,
            model=svc.model_name,
            version=version,
            device=info.device,
            weight_dtype=info.weight_dtype,
            compute=info.compute,
            kv_blocks=info.num_kv_blocks,
            max_context=info.max_context_length,
        )
        if svc.warmup:
            await warm_up(backend)

    async def on_drain() -> None:
        await servicer.drain(svc.grace_seconds)

    hooks = ServiceHooks(
        register=register,
        ready=ready,
        on_drain=on_drain,
        on_stop=backend.stop,
        require_service_token=True,
        tls=read_server_tls(svc.tls_cert_file, svc.tls_key_file, svc.tls_client_ca_file),
    )
    run(run_service("engine", svc, hooks))


if __name__ == "__main__":
    main()
