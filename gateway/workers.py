"""Several processes behind one gateway's ports: ``[gateway] workers`` > 1.

One Python process runs one event loop on one core. At a few milliseconds of CPU
per request, that caps a gateway at a few hundred requests a second, and a burst
of new streams queues behind the loop: each is accepted only after the ones before
it have been admitted. ``workers: N`` runs N worker processes. Each is a complete
gateway (both fronts, the admin services, its own Redis connections), and they all
listen on the same gRPC and HTTP ports with SO_REUSEPORT, so the kernel spreads new
connections across them. All streams of one HTTP/2 connection stay on one worker;
Envoy opens upstream connections per worker thread, and an HTTP/1.1 client opens
one connection per request in flight. Each worker is a replica in every other
respect (its own admission view, breakers, fair queues and caches; shared state is
in Redis, so an admin change made through one worker reaches the others within the
same cache bounds as it reaches other replicas).

This process supervises the workers and serves nothing itself:

- ports: an ephemeral port (0) is chosen here once and held (bound, never listening),
  so every worker, and every restart, binds the same one;
- readiness: the port file (and the ``serving`` log line) is written once every worker
  is SERVING;
- metrics: the metrics port serves every worker's metrics, each sample labelled
  ``worker="<index>"``, and ``gateway_workers_alive`` and
  ``gateway_worker_restarts_total`` of its own;
- a worker that exits is started again with the same index and ports (backoff from
  0.5 s, doubling to 30 s, reset once a worker has served for a minute);
- SIGTERM/SIGINT: forwarded to every worker, each of which drains its streams for
  ``grace_seconds``; whatever is still running after that (plus a margin) is killed.
  A worker also gets SIGTERM when the supervisor dies (``PR_SET_PDEATHSIG``), so none
  is orphaned.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from common.log import get_logger
from common.server import BoundPorts, write_port_file
from gateway.config import GatewayConfig

log = get_logger(__name__)

WORKER_ENV = "LLM_GATEWAY_WORKER"  # a worker's index, set by the supervisor
SUPERVISOR_ENV = "LLM_GATEWAY_SUPERVISOR"  # the supervisor's pid
STOP_MARGIN_S = 10.0  # past grace_seconds before the workers left are killed
START_TIMEOUT_S = 300.0
BACKOFF_MIN_S, BACKOFF_MAX_S, HEALTHY_AFTER_S = 0.5, 30.0, 60.0
_PR_SET_PDEATHSIG = 1


def reserve_port(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` with SO_REUSEPORT and never listening: it fixes
    an ephemeral port's number for the workers (and keeps other programs off it) while
    taking no connections itself."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host.strip("[]"), port))
    except OSError as e:
        sock.close()
        raise RuntimeError(f"gateway: could not bind {host}:{port} for the workers: {e}") from e
    return sock


def become_worker() -> int | None:
    """In a worker process: ask the kernel for SIGTERM when the supervisor dies, and
    exit at once if it is gone already. Returns the worker's index (None outside one)."""
    index = os.environ.get(WORKER_ENV)
    if index is None:
        return None
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if str(os.getppid()) != os.environ.get(SUPERVISOR_ENV):
        raise SystemExit("gateway worker: its supervisor exited before it started")
    return int(index)


# once a serving process is up: everything allocated so far (modules, protobuf
# descriptors, the tokenizer, config) lives as long as the process, so the collector
# stops scanning it, and a young generation of 10,000 objects instead of 700 (a
# request allocates hundreds) makes a collection every few dozen requests, not
# several per request. Cycles are still collected; reference counting frees the rest.
GC_THRESHOLDS = (10_000, 20, 10)


def settle_heap() -> None:
    """Freeze the start-up heap out of the cyclic collector and widen its young
    generation (``GC_THRESHOLDS``): the collector's share of a request's CPU was ~5-10%
    (``bench.gateway_bench --engine stub``). Call once the process serves."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


@dataclass
class Worker:
    """One worker process and what the supervisor knows of it."""

    index: int
    port_file: Path
    proc: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    restarts: int = 0
    backoff_s: float = BACKOFF_MIN_S
    restart_at: float | None = None  # when a dead worker is started again

    def ports(self) -> dict[str, Any] | None:
        """The worker's port file (written once it is SERVING), if it is this process's."""
        try:
            data: dict[str, Any] = json.loads(self.port_file.read_text())
        except (OSError, ValueError):
            return None
        if self.proc is None or data.get("pid") != self.proc.pid:
            return None  # a dead predecessor's
        return data

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class WorkerMetrics(Collector):
    """Every worker's metrics, scraped when this collector is, one ``worker`` label added."""

    def __init__(self, workers: Sequence[Worker], host: str) -> None:
        self.workers = workers
        self.host = "127.0.0.1" if host in ("0.0.0.0", "") else host.strip("[]")
        if self.host == "::":
            self.host = "::1"

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for w in list(self.workers):
            ports = w.ports()
            if not ports or ports.get("metrics") is None:
                continue
            host = f"[{self.host}]" if ":" in self.host else self.host
            try:
                url = f"http://{host}:{ports['metrics']}/metrics"
                with urllib.request.urlopen(url, timeout=2.0) as resp:
                    text = resp.read().decode()
            except OSError:
                continue  # a worker restarting: its samples are missing from this scrape
            for fam in text_string_to_metric_families(text):
                merged = families.get(fam.name)
                if merged is None:
                    merged = Metric(fam.name, fam.documentation, fam.type, fam.unit)
                    families[fam.name] = merged
                for s in fam.samples:
                    labels = {**s.labels, "worker": str(w.index)}
                    merged.add_sample(s.name, labels, s.value, s.timestamp, s.exemplar)
        yield from families.values()


@dataclass
class Supervisor:
    """Runs ``config.workers`` gateway workers on shared ports (module docstring).

    Args:
        config: The gateway section (its ``workers`` > 1).
        argv: The command line the supervisor got; each worker gets it too, with its own
            ports, port file and ``--workers 1`` after it (later flags win).
    """

    config: GatewayConfig
    argv: Sequence[str]
    workers: list[Worker] = field(default_factory=list)
    _stopping: bool = False
    _sockets: list[socket.socket] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix="gateway-workers-"))
        self.registry = CollectorRegistry()
        self.alive = Gauge(
            "gateway_workers_alive", "Worker processes running", registry=self.registry
        )
        self.restarts_total = Counter(
            "gateway_worker_restarts_total",
            "Workers started again after they exited",
            ["worker"],
            registry=self.registry,
        )
        self.workers = [
            Worker(i, self._dir / f"worker-{i}.ports.json") for i in range(self.config.workers)
        ]
        self.registry.register(WorkerMetrics(self.workers, self.config.host))

    def run(self) -> int:
        """Serve until SIGTERM/SIGINT; returns the exit status."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        metrics_server = None
        try:
            self.grpc_port = self._reserve(self.config.port)
            self.http_port = self._reserve(self.config.http_port)
            for w in self.workers:
                self._spawn(w)
            if not self._wait_ready():
                return 0 if self._stopping else 1  # asked to stop while starting: not a failure
            metrics_port = None
            if self.config.metrics_port >= 0:
                metrics_server, _ = start_http_server(
                    self.config.metrics_port, addr=self.config.host, registry=self.registry
                )
                metrics_port = int(metrics_server.server_port)
            self._write_port_file(metrics_port)
            log.info(
                "serving",
                host=self.config.host,
                port=self.grpc_port,
                http_port=self.http_port,
                metrics_port=metrics_port,
                workers=[w.proc.pid for w in self.workers if w.proc is not None],
            )
            while not self._stopping:
                self._watch()
                time.sleep(0.1)
            log.info("shutting down", grace_seconds=self.config.grace_seconds)
            return 0
        finally:
            self._stop_workers()
            if metrics_server is not None:
                metrics_server.shutdown()
                metrics_server.server_close()
            for sock in self._sockets:
                sock.close()
            shutil.rmtree(self._dir, ignore_errors=True)
            log.info("stopped")

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._stopping = True

    def _reserve(self, port: int) -> int:
        if port < 0:
            return port  # that front is off
        sock = reserve_port(self.config.host, port)
        self._sockets.append(sock)
        return int(sock.getsockname()[1])

    def _spawn(self, w: Worker) -> None:
        w.port_file.unlink(missing_ok=True)
        cmd = [
            sys.executable,
            "-m",
            "gateway",
            *self.argv,
            "--workers",
            "1",
            "--port",
            str(self.grpc_port),
            "--http-port",
            str(self.http_port),
            "--metrics-port",
            "0" if self.config.metrics_port >= 0 else "-1",
            "--port-file",
            str(w.port_file),
        ]
        env = {
            **os.environ,
            WORKER_ENV: str(w.index),
            SUPERVISOR_ENV: str(os.getpid()),
            "LLM_GATEWAY_REUSE_PORT": "1",
        }
        w.proc = subprocess.Popen(cmd, env=env)
        w.started_at = time.monotonic()
        w.restart_at = None
        self.alive.set(sum(x.alive() for x in self.workers))

    def _wait_ready(self) -> bool:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._stopping and time.monotonic() < deadline:
            dead = [w for w in self.workers if not w.alive()]
            if dead:
                log.error(
                    "a worker exited while starting; stopping",
                    worker=dead[0].index,
                    returncode=dead[0].proc.returncode if dead[0].proc else None,
                )
                return False
            if all(w.ports() for w in self.workers):
                return True
            time.sleep(0.1)
        if not self._stopping:
            log.error("workers did not become ready", timeout_s=START_TIMEOUT_S)
        return False

    def _watch(self) -> None:
        now = time.monotonic()
        for w in self.workers:
            if w.alive():
                if now - w.started_at > HEALTHY_AFTER_S:
                    w.backoff_s = BACKOFF_MIN_S
                continue
            if w.restart_at is None:
                code = w.proc.returncode if w.proc is not None else None
                w.restart_at = now + w.backoff_s
                log.error(
                    "worker exited; starting it again",
                    worker=w.index,
                    returncode=code,
                    in_s=w.backoff_s,
                )
                w.backoff_s = min(BACKOFF_MAX_S, 2 * w.backoff_s)
                self.alive.set(sum(x.alive() for x in self.workers))
            elif now >= w.restart_at:
                w.restarts += 1
                self.restarts_total.labels(str(w.index)).inc()
                self._spawn(w)

    def _write_port_file(self, metrics_port: int | None) -> None:
        if self.config.port_file:
            write_port_file(
                self.config.port_file,
                BoundPorts(self.grpc_port, metrics_port),
                http=self.http_port,
                workers=[w.proc.pid for w in self.workers if w.proc is not None],
            )

    def _stop_workers(self) -> None:
        running = [w.proc for w in self.workers if w.proc is not None and w.proc.poll() is None]
        for p in running:
            p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.config.grace_seconds + STOP_MARGIN_S
        for p in running:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.error("worker did not stop in time; killing it", pid=p.pid)
                p.kill()
                p.wait()
        self.alive.set(0)
