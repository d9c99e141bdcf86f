"""``bench.gateway_bench --engine stock-vllm`` (or ``stub-vllm``): our gateway and SMG in
front of one engine speaking VllmEngine.

Under ``stock-vllm`` the engine is vLLM's own gRPC server with smg-grpc-servicer
(``deploy.stock_vllm``, from vLLM's venv), nothing of ours inside it. Under
``stub-vllm`` it is the engine service with no model (``bench.gatewaylib.stub_engine``)
answering over the same VllmEngine protocol: every side then meets an engine that
spends no CPU and has no step-to-step jitter (each first token held
``--stub-first-token-ms``, the later ones ``--stub-token-gap-ms`` apart, without
computing), so what the sides differ by is the proxies alone, on any CPU. The gateway
reaches either as
``vllm://host:port`` (with Redis and the tokenizer service, ``bench.loadlib.spawn``,
and the model's tokenizer of its own, as ``make run``); SMG (``bench.gatewaylib.smg``)
reaches the same server as ``grpc://host:port`` and tokenizes with the same
directory. The sides (``bench.gatewaylib.sides``): ``engine`` (VllmEngine's Generate,
direct), ``floor`` (the bare grpc.aio relay, ``bench.gatewaylib.relay_floor``, making
the engine side's call), ``work`` (that relay with ``--work``: it also encodes every
prompt and detokenizes every chunk, as SMG does), ``gateway`` (our gRPC front),
``http`` (our OpenAI HTTP front, streamed), ``smg`` (SMG's OpenAI HTTP API, the
same request) and ``smg-tenant`` (a second SMG doing what the gateway does on it: the
bench tenant's API key only, the tenant's token and request buckets reserved and
settled per request, with the gateway's bench limits). The CPU of each side is
charged to the process in front of the engine there: the relays' on floor and work,
the gateway's (with its workers) on engine, gateway and http (on engine: its
background work, health and stats polls), each SMG's on its side.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.gatewaylib.limits import bench_limits
from bench.gatewaylib.smg import SmgProcess, SmgTenant
from bench.loadlib.spawn import Stack, StackSpec, on_cpus
from common.config import default_model_dir
from common.redis_server import free_port
from deploy.stock_vllm import StockVllm

STOCK_SIDES = ["engine", "floor", "work", "gateway", "http", "smg", "smg-tenant"]
STOCK_ENGINES = ("stock-vllm", "stub-vllm")  # the engines these sides run over


@dataclass(frozen=True, slots=True)
class StubTiming:
    """The stub engine's pace (``stub-vllm``): each first token held ``first_token_ms``,
    the later ones ``token_gap_ms`` apart, neither using the CPU."""

    first_token_ms: float = 0.0
    token_gap_ms: float = 0.0

    def env(self) -> dict[str, str]:
        """The stub engine's environment for this pace (``bench.gatewaylib.stub_engine``
        reads it)."""
        return {
            "LLM_ENGINE_CORE_DEVICE": "cpu",
            "STUB_FIRST_TOKEN_MS": str(self.first_token_ms),
            "STUB_TOKEN_GAP_MS": str(self.token_gap_ms),
        }


BENCH_ENGINE_ARGS = ["--max-num-seqs", "32"]  # every bench engine's batch: concurrency 32


@dataclass
class StockRun:
    """The started services: addresses per side, the proxies' pids (gateway, smg) and
    what the report records of the engine and SMG."""

    stack: Stack
    addresses: dict[str, str]
    proxies: dict[str, int]
    facts: dict[str, Any]


def cpu_owner(side: str) -> str:
    """Which process a side's CPU time is read from: ``smg``, ``smg-tenant``, ``floor``,
    ``work`` or ``gateway``."""
    return side if side in ("smg", "smg-tenant", "floor", "work") else "gateway"


@contextlib.contextmanager
def stock_stack(
    log_dir: Path,
    engine_dtype: str = "bfloat16",
    engine_cpus: set[int] | None = None,
    gateway_workers: int = 1,
    proxy_cpus: set[int] | None = None,
    stub: StubTiming | None = None,
    tenant_limited: bool = True,
) -> Iterator[StockRun]:
    """The engine (``stub`` None: the stock vLLM server, ``engine_dtype`` its ``--dtype``;
    else the stub engine at that pace; on ``engine_cpus``, vLLM's OpenMP threads bound
    to them), then Redis, the tokenizer and the gateway over it as ``vllm://``, the
    bare relays over it, then SMG over it, twice: plain, and with the bench tenant's
    key and (``tenant_limited``, as the gateway's bench key) the bench limits (the
    proxies on ``proxy_cpus``); everything stopped on exit, by pid, last started
    first."""
    model_dir = default_model_dir()
    with contextlib.ExitStack() as closing:
        spec = StackSpec(
            model_dir,
            log_dir,
            num_engines=0,
            gateway=True,
            # the gateway's own stats poll (not the load bench's faster one): its
            # background CPU is what a deployment pays, as SMG's is
            gateway_env={"LLM_GATEWAY_GRACE_SECONDS": "2"},
            gateway_args=["--log-level", "warning", "--workers", str(gateway_workers)],
            http_port=free_port(),
            proxy_cpus=proxy_cpus,
            gateway_model_dir=True,
        )
        stack = Stack(spec)
        if stub is None:
            engine = StockVllm(model_dir, port=free_port(), log_dir=log_dir, dtype=engine_dtype)
            with on_cpus(engine_cpus):
                engine.start(timeout=900)  # torch.compile on a busy 2-core machine is slow
            closing.callback(engine.stop)
            address, model_name = engine.address, engine.served_model_name or model_dir.name
            facts: dict[str, Any] = {
                "engine_server": "stock vLLM gRPC server (vllm.entrypoints.launchers."
                "grpc_server, smg-grpc-servicer)",
                "engine_dtype": engine.dtype,
                "engine_omp_threads_bind": ",".join(
                    str(c) for c in sorted(engine_cpus or os.sched_getaffinity(0))
                ),
            }
            closing.callback(stack.stop)  # before the engine's stop: the engine stops last
        else:
            closing.callback(stack.stop)  # the stub engine is the stack's first service
            address = start_stub_engine(stack, model_dir, stub, engine_cpus)
            model_name = model_dir.name
            facts = {
                "engine_server": "stub engine (bench.gatewaylib.stub_engine: the engine "
                "service with no model) speaking VllmEngine",
                "stub_first_token_ms": stub.first_token_ms,
                "stub_token_gap_ms": stub.token_gap_ms,
            }
        stack.engines.append(f"vllm://{address}")
        stack.start()
        relay = ["--engine", address, "--model-dir", str(model_dir)]
        relay += ["--engine-protocol", "vllm"]
        floor = stack.service("floor", "bench.gatewaylib.relay_floor", relay, proxy=True)
        work = stack.service(
            "floor-work", "bench.gatewaylib.relay_floor", [*relay, "--work"], proxy=True
        )
        smg = SmgProcess([f"grpc://{address}"], model_dir, log_dir)
        with on_cpus(proxy_cpus):
            smg.start()
        closing.callback(smg.stop)
        # the same SMG doing the gateway's job: the bench tenant's key, its limits
        limits = bench_limits(tenant_limited)  # none: SMG checks the key only
        tenant = SmgTenant(limits.tokens_per_minute, limits.requests_per_minute)
        smg_tenant = SmgProcess(
            [f"grpc://{address}"], model_dir, log_dir, name="smg-tenant", tenant=tenant
        )
        with on_cpus(proxy_cpus):
            smg_tenant.start()
        closing.callback(smg_tenant.stop)
        gw = stack.procs["bench-gateway"].proc
        assert gw is not None  # started above
        assert smg.proc is not None
        assert smg_tenant.proc is not None
        assert floor.proc is not None
        assert work.proc is not None
        yield StockRun(
            stack=stack,
            addresses={
                "engine": address,
                "engine_protocol": "vllm",
                "floor": floor.address,
                "work": work.address,
                "gateway": stack.gateway,
                "http": stack.http,
                "smg": smg.url,
                "smg_model": model_name,
                "smg-tenant": smg_tenant.url,
                "smg-tenant_model": model_name,
                "smg-tenant_key": tenant.key,
                "gateway_metrics": stack.metrics_url("bench-gateway"),
            },
            proxies={
                "gateway": gw.pid,
                "smg": smg.proc.pid,
                "floor": floor.proc.pid,
                "work": work.proc.pid,
                "smg-tenant": smg_tenant.proc.pid,
            },
            facts={**facts, "smg_command": " ".join(["smg", *smg.command[1:]])},
        )


def start_stub_engine(
    stack: Stack, model_dir: Path, stub: StubTiming, cpus: set[int] | None
) -> str:
    """The stub engine (stopped with ``stack``) on ``cpus``, at ``stub``'s pace; its
    address. It serves the standard protocols beside llm.v1, as the engine does."""
    args = ["--model-dir", str(model_dir), *BENCH_ENGINE_ARGS]
    with on_cpus(cpus):
        return stack.service(
            "bench-engine-0", "bench.gatewaylib.stub_engine", args, stub.env()
        ).address
