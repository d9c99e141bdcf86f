"""structlog set-up: JSON lines in production, readable output on a TTY.

Every record carries the service name and whatever is bound in the context
(request_id, tenant) by the request-id interceptor. In JSON mode every line a
service writes is one JSON object: records of the standard ``logging`` module
(libraries, ``warnings``) go through the same processors as structlog's, and
whatever reaches file descriptor 2 without a logger (native code, a child
process such as a compiler, a crash's traceback) is read back from a pipe and
written as a log event (``component`` "stderr"), one per line.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import sys
import threading
from collections.abc import Callable, MutableMapping
from typing import Any, TextIO

import structlog


def _component_from_logger_name(
    _: Any, __: str, event: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    """A stdlib record's logger name as the ``component`` field, as structlog's carry it."""
    record = event.get("_record")
    if record is not None:
        event.setdefault("component", record.name)
    return event


def configure_logging(service: str, level: str = "info", fmt: str = "auto") -> None:
    """Configure structlog and the stdlib root logger once per process."""
    use_json = fmt == "json" or (fmt == "auto" and not sys.stderr.isatty())
    stream: TextIO = _capture_stderr(service) if use_json else sys.stderr
    shared: list[Any] = [
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
        processors=[*shared, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(stream),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.bind_contextvars(service=service)
    handler = logging.StreamHandler(stream)
    if use_json:
        handler.setFormatter(
            structlog.stdlib.ProcessorFormatter(
                processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
                foreign_pre_chain=[_component_from_logger_name, *shared],
            )
        )
    else:
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s %(message)s"))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(lvl)
    logging.captureWarnings(True)  # warnings.warn(...) as records of "py.warnings"
    while _start_reader:
        _start_reader.pop()()


def _capture_stderr(service: str) -> TextIO:
    """Point file descriptor 2 at a pipe whose lines become log events; returns a stream
    on the real stderr for the loggers. Once per process (a later call reuses it). The
    pipe's reader is started by ``configure_logging`` once structlog is configured."""
    if _real_stderr:
        return _real_stderr[0]
    try:
        sys.stderr.flush()
        read_fd, write_fd = os.pipe()
        real_fd = os.dup(2)
        os.dup2(write_fd, 2)
        os.close(write_fd)
    except OSError:  # no usable fd 2: log to whatever sys.stderr is
        return sys.stderr
    real = open(real_fd, "w", buffering=1, encoding="utf-8", errors="backslashreplace")  # noqa: SIM115
    _real_stderr.append(real)
    reader = threading.Thread(
        target=_forward_lines, args=(read_fd, real, service), name="stderr-log", daemon=True
    )

    def restore() -> None:
        # the pipe's last writer is fd 2: closing it ends the reader once it has
        # written what is left (a crash's traceback included)
        sys.stderr.flush()
        os.dup2(real.fileno(), 2)
        if reader.is_alive():
            reader.join(timeout=2)

    _start_reader.append(reader.start)
    atexit.register(restore)
    return real


_real_stderr: list[TextIO] = []
_start_reader: list[Callable[[], None]] = []  # started once structlog is configured


def _forward_lines(read_fd: int, out: TextIO, service: str) -> None:
    """Each line written to fd 2: passed on when it already is a JSON object (a child
    service's own log), else wrapped as a warning event."""
    log = structlog.get_logger(component="stderr").bind(service=service)
    passed_on = structlog.PrintLogger(out)  # shares the loggers' lock on ``out``
    with open(read_fd, "rb") as pipe:
        for raw in pipe:
            line = raw.decode("utf-8", "backslashreplace").rstrip("\r\n")
            if not line.strip():
                continue
            if _is_json_object(line):
                passed_on.msg(line)
            else:
                log.warning(line)


def _is_json_object(line: str) -> bool:
    if not line.startswith("{"):
        return False
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False


def get_logger(name: str) -> Any:
    """A structlog logger; ``name`` becomes the ``component`` field."""
    return structlog.get_logger(component=name)
