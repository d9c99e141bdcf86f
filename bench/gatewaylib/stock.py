"""``bench.gateway_bench --engine stock-vllm``: our gateway and SMG in front of one stock
vLLM engine.

The engine is vLLM's own gRPC server with smg-grpc-servicer (``deploy.stock_vllm``,
from vLLM's venv), nothing of ours inside it. The gateway reaches it as
``vllm://host:port`` (with Redis and the tokenizer service, ``bench.loadlib.spawn``,
and the model's tokenizer of its own, as ``make run``); SMG (``bench.gatewaylib.smg``)
reaches the same server as ``grpc://host:port`` and tokenizes with the same
directory. The sides (``bench.gatewaylib.sides``): ``engine`` (VllmEngine's Generate,
direct), ``floor`` (the bare grpc.aio relay, ``bench.gatewaylib.relay_floor``, making
the engine side's call), ``gateway`` (our gRPC front), ``http`` (our OpenAI HTTP front,
streamed) and ``smg`` (SMG's OpenAI HTTP API, the same request). The CPU of each side
is charged to the process in front of the engine there: the relay's on floor, the
gateway's (with its workers) on engine, gateway and http (on engine: its background
work, health and stats polls), SMG's on smg.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.gatewaylib.smg import SmgProcess
from bench.loadlib.spawn import Stack, StackSpec, on_cpus
from common.config import default_model_dir
from common.redis_server import free_port
from deploy.stock_vllm import StockVllm

STOCK_SIDES = ["engine", "floor", "gateway", "http", "smg"]


@dataclass
class StockRun:
    """The started services: addresses per side, the proxies' pids (gateway, smg) and
    what the report records of the engine and SMG."""

    stack: Stack
    addresses: dict[str, str]
    proxies: dict[str, int]
    facts: dict[str, Any]


def cpu_owner(side: str) -> str:
    """Which process a side's CPU time is read from: ``smg``, ``floor`` or ``gateway``."""
    return side if side in ("smg", "floor") else "gateway"


@contextlib.contextmanager
def stock_stack(
    log_dir: Path,
    engine_dtype: str = "bfloat16",
    engine_cpus: set[int] | None = None,
    gateway_workers: int = 1,
    proxy_cpus: set[int] | None = None,
) -> Iterator[StockRun]:
    """The stock vLLM server (``engine_dtype``: its ``--dtype``; on ``engine_cpus``, its
    OpenMP threads bound to them), then Redis, the tokenizer and the gateway over it as
    ``vllm://``, the bare relay over it, then SMG over it (the proxies on
    ``proxy_cpus``); everything stopped on exit, by pid, last started first."""
    model_dir = default_model_dir()
    with contextlib.ExitStack() as closing:
        engine = StockVllm(model_dir, port=free_port(), log_dir=log_dir, dtype=engine_dtype)
        with on_cpus(engine_cpus):
            engine.start(timeout=900)  # torch.compile on a busy 2-core machine is slow
        closing.callback(engine.stop)
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
        stack.engines.append(f"vllm://{engine.address}")
        stack.start()
        closing.callback(stack.stop)
        relay = ["--engine", engine.address, "--model-dir", str(model_dir)]
        relay += ["--engine-protocol", "vllm"]
        floor = stack.service("floor", "bench.gatewaylib.relay_floor", relay, proxy=True)
        smg = SmgProcess([f"grpc://{engine.address}"], model_dir, log_dir)
        with on_cpus(proxy_cpus):
            smg.start()
        closing.callback(smg.stop)
        gw = stack.procs["bench-gateway"].proc
        assert gw is not None  # started above
        assert smg.proc is not None
        assert floor.proc is not None
        yield StockRun(
            stack=stack,
            addresses={
                "engine": engine.address,
                "engine_protocol": "vllm",
                "floor": floor.address,
                "gateway": stack.gateway,
                "http": stack.http,
                "smg": smg.url,
                "smg_model": engine.served_model_name or model_dir.name,
                "gateway_metrics": stack.metrics_url("bench-gateway"),
            },
            proxies={"gateway": gw.pid, "smg": smg.proc.pid, "floor": floor.proc.pid},
            facts={
                "engine_server": "stock vLLM gRPC server (vllm.entrypoints.launchers.grpc_server, "
                "smg-grpc-servicer)",
                "engine_dtype": engine.dtype,
                "engine_omp_threads_bind": ",".join(
                    str(c) for c in sorted(engine_cpus or os.sched_getaffinity(0))
                ),
                "smg_command": " ".join(["smg", *smg.command[1:]]),
            },
        )
