"""Production log mode: every line a process writes to stderr is one JSON object,
whoever wrote it (structlog, the logging module, warnings, native code writing to fd 2,
a child process, a crash's traceback)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from common.config import ROOT

SCRIPT = textwrap.dedent(
    """
    import logging, os, subprocess, sys, warnings
    from common.log import configure_logging, get_logger
    configure_logging("probe", "info", sys.argv[1])
    get_logger("probe.main").info("structlog event", n=1)
    logging.getLogger("probe.stdlib").info("stdlib %s", "record")
    warnings.warn("a library warning")
    os.write(2, b"native line one\\nnative line two\\n")
    subprocess.run(["sh", "-c", "echo compiler output >&2"], check=True)
    os.write(2, b'{"event": "a child service", "service": "child"}\\n')
    """
)


def run(fmt: str, script: str = SCRIPT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", script, fmt],
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
    )


def events(stderr: str) -> list[dict[str, object]]:
    out = []
    for line in stderr.splitlines():
        obj = json.loads(line)  # fails the test on any line that is not JSON
        assert isinstance(obj, dict), line
        out.append(obj)
    return out


def test_every_line_is_a_json_object() -> None:
    proc = run("json")
    assert proc.returncode == 0, proc.stderr
    got = events(proc.stderr)
    by_event = {str(e["event"]): e for e in got}
    assert by_event["structlog event"]["component"] == "probe.main"
    stdlib = by_event["stdlib record"]
    assert stdlib["component"] == "probe.stdlib"
    assert stdlib["level"] == "info"
    assert stdlib["service"] == "probe"
    assert any("a library warning" in str(e["event"]) for e in got)
    for raw in ("native line one", "native line two", "compiler output"):
        assert by_event[raw]["component"] == "stderr", raw
        assert by_event[raw]["service"] == "probe"
    # a child service's own JSON line is passed on as it is, not wrapped
    assert by_event["a child service"] == {"event": "a child service", "service": "child"}
    assert all("timestamp" in e for e in got if e["service"] == "probe")


def test_a_crash_traceback_is_logged_too() -> None:
    proc = run("json", SCRIPT + "raise RuntimeError('boom')\n")
    assert proc.returncode == 1
    got = events(proc.stderr)
    assert any(str(e["event"]).startswith("Traceback") for e in got)
    assert any("RuntimeError: boom" in str(e["event"]) for e in got)


def test_console_mode_leaves_stderr_alone() -> None:
    proc = run("console")
    assert proc.returncode == 0, proc.stderr
    assert "native line one\n" in proc.stderr  # raw, as written
    assert "stdlib record" in proc.stderr
