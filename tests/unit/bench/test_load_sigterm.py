"""bench.load --spawn stops the services it started when it is sent SIGTERM."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any, ClassVar

import pytest

from bench import load


class RecordingStack:
    """Stands in for the spawned services: records whether they were stopped."""

    instances: ClassVar[list[RecordingStack]] = []

    def __init__(self, spec: Any) -> None:
        self.stopped = False
        self.engines: list[str] = ["127.0.0.1:1"]
        self.gateway = self.envoy = ""
        RecordingStack.instances.append(self)

    def __enter__(self) -> RecordingStack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopped = True


def test_sigterm_during_a_spawned_run_stops_the_stack(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(load, "Stack", RecordingStack)

    def execute(*_: object) -> None:  # the run is under way when the signal comes
        os.kill(os.getpid(), signal.SIGTERM)
        raise AssertionError("SIGTERM did not interrupt the run")

    monkeypatch.setattr(load, "execute", execute)
    previous = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(SystemExit) as exc:
            load.main(["run", "--spawn", "--target", "engine", "--out-dir", str(tmp_path)])
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert exc.value.code == 128 + signal.SIGTERM
    assert RecordingStack.instances[-1].stopped
