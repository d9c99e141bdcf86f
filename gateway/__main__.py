"""``python -m gateway``: serve llm.v1.Gateway and llm.v1.RateLimitAdmin in one process.

    python -m gateway --engines 127.0.0.1:50071,127.0.0.1:50072 \\
        --tokenizer 127.0.0.1:50061 --redis-url redis://127.0.0.1:6379/0 [--port 50051]

The OpenAI-compatible HTTP front (``/v1/chat/completions``, ``/v1/completions``,
``/v1/models``) serves on ``--http-port`` (``[gateway] http_port``, 8000) in the
same process. Config sections ``gateway`` and ``ratelimit`` (YAML < env < flags). Tenant
keys call Gateway; the admin key (``[ratelimit] admin_key``, ``$ADMIN_KEY`` or
``--admin-key-file``) calls RateLimitAdmin and RoutingAdmin (model versions,
canary weights, rollback). SIGTERM: health NOT_SERVING, new
requests UNAVAILABLE, streams in flight get ``grace_seconds``. ``--workers N`` (``[gateway]
workers``) runs N such processes on the same ports under a supervisor (``gateway.workers``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import grpc
import structlog

from common.config import add_service_args, load_config, service_overrides
from common.log import configure_logging
from common.server import ServiceHooks, run, run_service
from gateway.app import GatewayApp
from gateway.config import GatewayConfig
from gateway.fronts import grpc_servicer as service
from gateway.fronts.forwarded import TrustedProxies
from gateway.fronts.http import HttpFront
from gateway.release import routing_admin
from gateway.request.authenticate import ReflectionAuthInterceptor
from gateway.workers import Supervisor, become_worker, settle_heap
from ratelimit.admin.servicer import add_to_server as add_admin_to_server
from ratelimit.config import RateLimitConfig


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line flags (they override the YAML file and the environment)."""
    parser = argparse.ArgumentParser(
        prog="python -m gateway",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_service_args(parser)
    parser.add_argument("--engines", help="comma-separated engine replicas, host:port")
    parser.add_argument("--tokenizer", help="tokenizer_svc address, host:port")
    parser.add_argument("--redis-url", help="Redis for keys, tenants and limits")
    parser.add_argument("--redis-username", help="Redis ACL user")
    parser.add_argument("--redis-password-file", help="file holding the Redis user's password")
    parser.add_argument("--model-dir", help="a tokenizer for engines that serve none")
    parser.add_argument("--admin-key-file", help="file holding the bootstrap admin key")
    parser.add_argument("--failover", choices=["on", "off"], help="mid-stream failover")
    parser.add_argument(
        "--http-port", type=int, help="OpenAI-compatible HTTP port (0 = ephemeral, -1 = off)"
    )
    parser.add_argument(
        "--workers", type=int, help="processes sharing the ports (SO_REUSEPORT); 1 = this one"
    )
    return parser.parse_args(argv)


def load_configs(args: argparse.Namespace) -> tuple[GatewayConfig, RateLimitConfig]:
    """The ``gateway`` and ``ratelimit`` sections with the flags applied."""
    failover = None if args.failover is None else args.failover == "on"
    gw = load_config(
        GatewayConfig,
        "gateway",
        path=args.config,
        overrides={
            **service_overrides(args),
            "engines": args.engines,
            "tokenizer": args.tokenizer,
            "model_dir": args.model_dir,
            "failover": failover,
            "http_port": args.http_port,
            "workers": args.workers,
        },
    )
    rl = load_config(
        RateLimitConfig,
        "ratelimit",
        path=args.config,
        overrides={
            "redis_url": args.redis_url,
            "admin_key_file": args.admin_key_file,
            "redis_username": args.redis_username,
            "redis_password_file": args.redis_password_file,
        },
    )
    return gw, rl


async def serve(config: GatewayConfig, rl_config: RateLimitConfig) -> None:
    """Run until SIGTERM/SIGINT."""
    app = GatewayApp.from_config(config, rl_config)
    gateway_servicer = service.GatewayServicer(app.pipeline, TrustedProxies(config.trusted_proxies))
    admin_servicer = app.stack.servicer()

    def register(server: grpc.aio.Server) -> list[str]:
        return [
            *service.add_to_server(gateway_servicer, server),
            *add_admin_to_server(admin_servicer, server),
            *routing_admin.add_to_server(app.release.servicer(), server),
        ]

    http = None
    if config.http_port >= 0:
        http = HttpFront(
            app.pipeline,
            config.host,
            config.http_port,
            reuse_port=config.reuse_port,
            body_timeout_s=config.http_body_timeout_s,
            max_bodies_per_tenant=config.http_max_bodies_per_tenant,
            trusted_proxies=config.trusted_proxies,
        )

    async def ready() -> None:
        await app.start()
        if http is not None:
            await http.start()
        settle_heap()

    async def stop() -> None:
        if http is not None:
            await http.stop()
        await app.close()

    # SIGTERM: app.drain makes the pipeline refuse new requests (gRPC and HTTP alike,
    # /health answers 503) and waits for streams in flight; then both servers stop.
    hooks = ServiceHooks(
        register=register,
        ready=ready,
        on_drain=app.drain,
        on_stop=stop,
        interceptors=[ReflectionAuthInterceptor(app.stack.registry)],
    )
    await run_service("gateway", config, hooks)


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point: one gateway process, or with ``workers`` > 1 their supervisor."""
    argv = list(sys.argv[1:] if argv is None else argv)
    config, rl_config = load_configs(parse_args(argv))
    configure_logging("gateway", config.log_level, config.log_format)
    if config.workers > 1:
        raise SystemExit(Supervisor(config, argv).run())
    index = become_worker()
    if index is not None:
        structlog.contextvars.bind_contextvars(worker=index)
    run(serve(config, rl_config))


if __name__ == "__main__":
    main()
