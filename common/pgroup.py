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
