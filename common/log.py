"""structlog set-up: JSON lines in production, readable output on a TTY.

Every record carries the service name and whatever is bound in the context
(request_id, tenant) by the request-id interceptor.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog


def configure_logging(service: str, level: str = "info", fmt: str = "auto") -> None:
    """Configure structlog and the stdlib root logger once per process."""
    use_json = fmt == "json" or (fmt == "auto" and not sys.stderr.isatty())
    processors: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
        structlog.processors.format_exc_info,
    ]
    renderer: Any = (
        structlog.processors.JSONRenderer() if use_json else structlog.dev.ConsoleRenderer()
    )
    lvl = logging.getLevelNamesMapping().get(level.upper(), logging.INFO)
    structlog.configure(
        processors=[*processors, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.bind_contextvars(service=service)
    logging.basicConfig(level=lvl, stream=sys.stderr, format="%(levelname)s %(name)s %(message)s")


def get_logger(name: str) -> Any:
    """A structlog logger; ``name`` becomes the ``component`` field."""
    return structlog.get_logger(component=name)
