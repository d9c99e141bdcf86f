"""Stopping a subprocess that runs in its own process group (no gRPC imported here).

Every launcher in the project (services, Redis, Envoy) starts its child with
``start_new_session=True`` and stops it only through this function: by the
child's own pid, so nothing it did not start is ever signalled.
"""

from __future__ import annotations

import os
import signal
import subprocess
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


class LoggedChild:
    """Mixin for launchers of one child process whose output goes to a log file.

    The launcher sets ``proc`` (started with ``start_new_session=True``) and
    ``_log`` (the open log file); ``stop`` and the log handling live here once.
    """

    proc: subprocess.Popen[bytes] | None
    _log: IO[bytes] | None
    stop_timeout: float = 10.0

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
