"""The services ``bench.gateway_bench`` measures, on ``bench.loadlib.spawn.Stack``.

``--engine stub`` runs the engine service with no model behind it
(``bench.gatewaylib.stub_engine``: its gRPC server, servicer and checks, tokens at
once) under both the direct side and the gateway. The paired difference is then the
gateway's cost alone, without the model's step-to-step jitter, and it includes what a
real prefill would hide: the first chunk waits for the admission's Redis answer. It
measures the proxy the way proxies publish their overhead (against a fake upstream),
never the stack's serving speed.
"""

from __future__ import annotations

from pathlib import Path

from bench.gatewaylib.limits import bench_limits
from bench.gatewaylib.stock import BENCH_ENGINE_ARGS, StubTiming
from bench.loadlib.spawn import Stack, StackSpec, admin_client, tenant_key
from common.config import default_model_dir
from common.redis_server import free_port
from llm.v1 import admin_pb2

ENGINE_MODULES = {"model": "engine_svc", "stub": "bench.gatewaylib.stub_engine"}


def start_stack(
    log_dir: Path,
    engine_dtype: str = "float32",
    engine: str = "model",
    stub: StubTiming | None = None,
    engine_cpus: set[int] | None = None,
    gateway_workers: int = 1,
    proxy_cpus: set[int] | None = None,
) -> tuple[Stack, dict[str, str]]:
    """Redis, tokenizer, engine, gateway and bare relay on free ports
    (``bench.loadlib.spawn.Stack``), and the address of each side. With ``engine_cpus``
    the engine runs on those CPUs alone, one torch thread per CPU; with ``proxy_cpus``
    the bare relay and the gateway (its workers inherit them) on those; the rest
    inherit the caller's affinity."""
    model_dir = str(default_model_dir())
    spec = StackSpec(
        Path(model_dir),
        log_dir,
        gateway=True,
        engine_module=ENGINE_MODULES[engine],
        engine_env={**(stub or StubTiming()).env(), "LLM_ENGINE_CORE_DTYPE": engine_dtype},
        engine_args=list(BENCH_ENGINE_ARGS),
        gateway_env={},
        gateway_args=["--log-level", "warning", "--workers", str(gateway_workers)],
        http_port=free_port(),
        engine_cpus=engine_cpus,
        proxy_cpus=proxy_cpus,
        # the gateway's tokenizer from the engine, as this bench has always measured it
        # (with a model directory of its own, the gateway's first token read ~0.3 ms later)
        gateway_model_dir=False,
    )
    stack = Stack(spec).start()
    try:
        relay = ["--engine", stack.engines[0], "--model-dir", model_dir]
        floor = stack.service("floor", "bench.gatewaylib.relay_floor", relay, proxy=True)
    except BaseException:
        stack.stop()
        raise
    return stack, {
        "engine": stack.engines[0],
        "floor": floor.address,
        "gateway": stack.gateway,
        "http": stack.http,
        "gateway_metrics": stack.metrics_url("bench-gateway"),
    }


def make_key(address: str, admin_key: str, limited: bool = True) -> str:
    """An API key of the bench tenant: with ``BENCH_LIMITS``, or with no limit at all
    (then the gateway skips the token check: one Redis call before the engine)."""
    with admin_client(address) as admin:
        tenant = admin_pb2.Tenant(id="bench", limits=bench_limits(limited))
        return tenant_key(admin, admin_key, tenant)
