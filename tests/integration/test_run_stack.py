"""`make run`'s supervisor: starts the stack, prints how to call it, Ctrl-C stops all."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import grpc
import pytest

from common.config import ROOT
from llm.v1 import tokenizer_pb2, tokenizer_pb2_grpc

pytestmark = pytest.mark.integration


def test_run_stack_serves_then_stops_everything_on_ctrl_c() -> None:
    env = {**os.environ, "LLM_TOKENIZER_PORT": "0", "LLM_TOKENIZER_METRICS_PORT": "0",
           "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "scripts.run_stack"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "Ctrl-C stops everything" in line:
                break
        out = "".join(lines)
        match = re.search(r"tokenizer\s+grpc (127\.0\.0\.1:\d+)", out)
        assert match, out
        with grpc.insecure_channel(match.group(1)) as ch:
            stub = tokenizer_pb2_grpc.TokenizerStub(ch)
            assert stub.Encode(tokenizer_pb2.EncodeRequest(text="hi"), timeout=10).token_ids
        child_pid = int(re.search(r'"pid": (\d+)', (ROOT / ".run/logs/tokenizer.ports.json")
                                  .read_text()).group(1))  # type: ignore[union-attr]
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out + rest
        assert "tokenizer stopped (exit code 0)" in rest
        with pytest.raises(ProcessLookupError):
            os.kill(child_pid, 0)  # the service is gone, not orphaned
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
