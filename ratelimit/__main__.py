"""``python -m ratelimit``: serve RateLimitAdmin (with health and reflection) alone.

    python -m ratelimit --redis-url redis://127.0.0.1:6379/0 --port 50081

The admin key comes from ``[ratelimit] admin_key``, ``$ADMIN_KEY`` or
``--admin-key-file``; it is registered (as a SHA-256) at start-up.
"""

from __future__ import annotations

import argparse

from common.config import add_service_args, load_config, service_overrides
from common.log import configure_logging
from common.server import ServiceHooks, run, run_service
from ratelimit.admin.servicer import add_to_server
from ratelimit.config import RateLimitConfig
from ratelimit.factory import RateLimitStack


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags (they override the YAML file and the environment)."""
    parser = argparse.ArgumentParser(prog="python -m ratelimit", description=__doc__)
    add_service_args(parser)
    parser.add_argument("--redis-url")
    parser.add_argument("--redis-username", help="Redis ACL user")
    parser.add_argument("--redis-password-file", help="file holding the Redis user's password")
    parser.add_argument("--key-prefix")
    parser.add_argument("--fail-mode", choices=["open", "closed"])
    parser.add_argument("--admin-key-file")
    return parser.parse_args(argv)


async def serve(config: RateLimitConfig) -> None:
    """Run until SIGTERM/SIGINT."""
    stack = RateLimitStack.from_config(config)
    servicer = stack.servicer()
    hooks = ServiceHooks(
        register=lambda server: add_to_server(servicer, server),
        ready=stack.start,
        on_stop=stack.aclose,
    )
    await run_service("ratelimit", config, hooks)


def main(argv: list[str] | None = None) -> None:
    """Entry point."""
    args = parse_args(argv)
    overrides = {
        **service_overrides(args),
        "redis_url": args.redis_url,
        "redis_username": args.redis_username,
        "redis_password_file": args.redis_password_file,
        "key_prefix": args.key_prefix,
        "fail_mode": args.fail_mode,
        "admin_key_file": args.admin_key_file,
    }
    config = load_config(RateLimitConfig, "ratelimit", path=args.config, overrides=overrides)
    configure_logging("ratelimit", config.log_level, config.log_format)
    run(serve(config))


if __name__ == "__main__":
    main()
