"""The one child-process helper of every launcher (services, Redis, Envoy); no gRPC
imported here.

A launcher starts its child through ``LoggedChild.spawn``: its own session (process
group), output to a log file, no stdin. It waits for readiness with ``wait_ready``
(which fails with the log's tail when the child exits or takes too long) and stops
it only by the child's own pid (``stop_process_group``: SIGTERM, then SIGKILL), so
nothing it did not start is ever signalled.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO


def stop_process_group(proc: subprocess.Popen[bytes], timeout: float = 10.0) -> int | None:
    """SIGTERM the child's process group, SIGKILL it after ``timeout``; returns the exit code."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)
        except ProcessLookupError:
            pass
    return proc.returncode


def tail(path: Path, num_lines: int = 40) -> str:
    """The last lines of a log file, for error messages."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-num_lines:])
    except FileNotFoundError:
        return "(no log)"


class ChildStartError(RuntimeError):
    """The child exited or did not become ready in time; carries its log tail."""


class LoggedChild:
    """Base of the launchers of one child process whose output goes to a log file.

    Subclasses set ``name`` and ``log_path`` and call ``spawn`` then ``wait_ready``;
    signals, stop and the log handling live here once.
    """

    name: str
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    _log: IO[bytes] | None = None
    stop_timeout: float = 10.0
    start_error: type[RuntimeError] = ChildStartError

    def spawn(
        self,
        cmd: Sequence[str],
        *,
        cwd: Path | None = None,
        env: Mapping[str, str] | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start ``cmd`` in a session of its own, output appended to ``log_path``."""
        self._close_log()  # a restart after kill()
        self._log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            list(cmd),
            cwd=cwd,
            env=None if env is None else dict(env),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        return self.proc

    def wait_ready(self, ready: Callable[[], bool], timeout: float, poll_s: float = 0.05) -> None:
        """Poll ``ready()`` until it is true. Raises ``start_error`` with the log's tail
        when the child exits first or ``timeout`` passes (the child is stopped then)."""
        assert self.proc is not None, "spawn() first"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self._close_log()
                raise self.start_error(
                    f"{self.name} exited with code {self.proc.returncode} during start-up; "
                    f"log {self.log_path}:\n{tail(self.log_path)}"
                )
            if ready():
                return
            time.sleep(poll_s)
        self.stop()
        raise self.start_error(
            f"{self.name} was not ready after {timeout:.0f}s; log {self.log_path}:\n"
            f"{tail(self.log_path)}"
        )

    @property
    def running(self) -> bool:
        """True while the child is alive."""
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int, group: bool = True) -> None:
        """Send ``sig`` to the child's process group, or with ``group=False`` to the child
        alone (as Kubernetes and ``docker stop`` deliver SIGTERM: to PID 1 only)."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                if group:
                    os.killpg(self.proc.pid, sig)
                else:
                    self.proc.send_signal(sig)
            except ProcessLookupError:
                pass

    def kill(self, timeout: float = 10.0) -> None:
        """SIGKILL the process group and reap it (a crash: no shutdown)."""
        if self.proc is not None and self.proc.poll() is None:
            self.signal(signal.SIGKILL)
            self.proc.wait(timeout)
        self._close_log()

    def stop(self, timeout: float | None = None) -> int | None:
        """SIGTERM the process group, SIGKILL after ``timeout``. Returns the exit code."""
        if self.proc is None:
            return None
        code = stop_process_group(self.proc, self.stop_timeout if timeout is None else timeout)
        self._close_log()
        return code

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None
