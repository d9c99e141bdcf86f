"""The one child-process helper every launcher uses (services, Redis, Envoy): a real
child in its own process group, readiness with the log's tail on failure, stop by pid."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import pytest

from common.pgroup import ChildStartError, LoggedChild


def alive(pid: int) -> bool:
    """Running (a zombie waiting for a reaper counts as dead)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


class Child(LoggedChild):
    def __init__(self, log_dir: Path) -> None:
        self.name = "child"
        self.log_path = log_dir / "child.log"


def test_a_child_that_exits_during_start_up_fails_with_its_log(tmp_path: Path) -> None:
    c = Child(tmp_path)
    c.spawn([sys.executable, "-c", "print('bad config: port 99999'); raise SystemExit(3)"])
    with pytest.raises(ChildStartError, match=r"(?s)exited with code 3.*bad config"):
        c.wait_ready(lambda: False, timeout=30)
    assert not c.running


def test_a_child_never_ready_is_stopped_with_its_group(tmp_path: Path) -> None:
    c = Child(tmp_path)
    # the child starts a grandchild in the same group; both must be gone afterwards
    code = (
        "import subprocess, sys, time\n"
        "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print('grandchild', g.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    proc = c.spawn([sys.executable, "-c", code])
    with pytest.raises(ChildStartError, match="was not ready after"):
        c.wait_ready(lambda: False, timeout=2)
    assert proc.poll() is not None
    grandchild = int(c.log_path.read_text().split("grandchild")[1].split()[0])
    deadline = time.monotonic() + 10
    while alive(grandchild):
        assert time.monotonic() < deadline, "the grandchild outlived its group's stop"
        time.sleep(0.05)


def test_kill_then_restart_reuses_the_log(tmp_path: Path) -> None:
    c = Child(tmp_path)
    c.spawn([sys.executable, "-c", "print('first', flush=True); import time; time.sleep(60)"])
    c.wait_ready(lambda: "first" in c.log_path.read_text(), timeout=30)
    c.kill()
    assert c.proc is not None
    assert c.proc.returncode == -signal.SIGKILL
    c.spawn([sys.executable, "-c", "print('second', flush=True)"])
    assert c.proc.wait(30) == 0
    c.stop()
    assert c.log_path.read_text().split() == ["first", "second"]
