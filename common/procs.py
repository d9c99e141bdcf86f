"""Start, watch and stop service subprocesses (used by `make run` and the tests).

Each service runs in its own session (process group), writes its bound ports
to a port file once it is SERVING, and is stopped by pid: SIGTERM to its
group, then SIGKILL after a timeout. Nothing here kills a process it did not
start.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.config import ROOT
from common.pgroup import ChildStartError, LoggedChild


class ServiceStartError(ChildStartError):
    """The service exited or did not become healthy in time; carries its log tail."""


def check_health(address: str, service: str = "", timeout: float = 2.0) -> bool:
    """True when ``grpc.health.v1.Health/Check`` answers SERVING."""
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError:
            return False
    return bool(resp.status == health_pb2.HealthCheckResponse.SERVING)


@dataclass
class ManagedProcess(LoggedChild):
    """One service subprocess: ``python -m <module> <args>`` with a port file.

    ``launcher`` replaces ``python -m`` (the module name and args follow it) and
    ``cwd`` the repository root, e.g. to run a service from an image's file layout.
    """

    start_error = ServiceStartError

    name: str
    module: str
    # SIGTERM lets a service drain in-flight work for its grace period: give it that
    # long and a margin before SIGKILL (a kill loses streams and unsettled usage)
    stop_timeout: float = 15.0
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    log_dir: Path | None = None
    launcher: list[str] | None = None
    cwd: Path | None = None
    host: str = "127.0.0.1"
    proc: subprocess.Popen[bytes] | None = None
    port: int = 0
    metrics_port: int | None = None
    log_path: Path = field(init=False)
    _port_file: Path = field(init=False)
    _log: IO[bytes] | None = None

    def __post_init__(self) -> None:
        d = self.log_dir or Path(tempfile.mkdtemp(prefix=f"{self.name}-"))
        d.mkdir(parents=True, exist_ok=True)
        self.log_path = d / f"{self.name}.log"
        self._port_file = d / f"{self.name}.ports.json"

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self, timeout: float = 120.0) -> ManagedProcess:
        """Start and block until the port file exists and health is SERVING."""
        self._port_file.unlink(missing_ok=True)
        env = {**os.environ, **self.env, "PYTHONUNBUFFERED": "1"}
        env.setdefault("PYTHONPATH", str(ROOT))
        run = self.launcher or [sys.executable, "-m"]
        cmd = [*run, self.module, *self.args, "--port-file", str(self._port_file)]
        self.spawn(cmd, cwd=self.cwd or ROOT, env=env)
        self.wait_ready(self._healthy, timeout, poll_s=0.1)
        return self

    def _healthy(self) -> bool:
        if not self._port_file.exists():
            return False
        ports = json.loads(self._port_file.read_text())
        self.port, self.metrics_port = int(ports["grpc"]), ports.get("metrics")
        return check_health(self.address)

    def __enter__(self) -> ManagedProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
