"""`make run`: start the stack on this machine, print how to call it, stop on Ctrl-C.

Services start in dependency order, each as a subprocess in its own process
group with its log under .run/logs/, and each must report SERVING on
grpc.health.v1 before the next starts. Ctrl-C (or SIGTERM) stops them in
reverse order, by pid; if one dies, the rest are stopped too.

What runs today: the tokenizer service and one engine replica (native
backend). Redis, the gateway and Envoy join this list as their issues land.
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path
from types import FrameType

from common.config import ROOT, load_config
from common.procs import ManagedProcess, ServiceStartError
from engine_svc.__main__ import EngineServiceConfig
from tokenizer_svc.__main__ import TokenizerConfig

RUN_DIR = ROOT / ".run"


def _services(log_dir: Path) -> list[ManagedProcess]:
    tok = load_config(TokenizerConfig, "tokenizer")
    eng = load_config(EngineServiceConfig, "engine")
    return [
        ManagedProcess(
            name="tokenizer", module="tokenizer_svc", log_dir=log_dir, host=tok.host,
            args=["--port", str(tok.port), "--metrics-port", str(tok.metrics_port),
                  "--log-format", "json"],
        ),
        ManagedProcess(
            name="engine-0", module="engine_svc", log_dir=log_dir, host=eng.host,
            args=["--port", str(eng.port), "--metrics-port", str(eng.metrics_port),
                  "--log-format", "json"],
        ),
    ]


def _banner(procs: list[ManagedProcess]) -> str:
    by_name = {p.name: p for p in procs}
    tok = by_name["tokenizer"]
    eng = by_name["engine-0"]
    exe = Path(sys.executable)
    py = exe.relative_to(ROOT) if exe.is_relative_to(ROOT) else "python"
    lines = [
        "",
        "The stack is up:",
        *(f"  {p.name:<10} grpc {p.address:<22} metrics http://{p.host}:{p.metrics_port}/metrics"
          f"   log {p.log_path.relative_to(ROOT)}" for p in procs),
        "",
        "Try it:",
        f"  {py} -m tokenizer_svc.client --address {tok.address} encode 'Hello, world!'",
        f"  {py} -m tokenizer_svc.client --address {tok.address} "
        "chat 'What is the capital of France?'",
        f"  {py} -m tokenizer_svc.client --address {tok.address} decode 19556 28 905 17",
        f"  {py} -m engine_svc.client --address {eng.address} "
        f"--tokenizer {tok.address} 'What is the capital of France?'",
        "  (or any gRPC client: the services serve reflection, e.g. "
        f"grpcurl -plaintext {tok.address} list)",
        "",
        "Ctrl-C stops everything.",
    ]
    return "\n".join(lines)


def main() -> int:
    log_dir = RUN_DIR / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    procs = _services(log_dir)
    started: list[ManagedProcess] = []
    stopping = False

    def on_signal(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    code = 0
    try:
        for p in procs:
            print(f"starting {p.name} ...", flush=True)
            started.append(p.start(timeout=180))
            if stopping:
                break
        if not stopping:
            print(_banner(started), flush=True)
        while not stopping:
            for p in started:
                if p.proc is not None and p.proc.poll() is not None:
                    print(f"{p.name} exited with code {p.proc.returncode}; "
                          f"see {p.log_path}", file=sys.stderr)
                    stopping, code = True, 1
            time.sleep(0.5)
    except ServiceStartError as e:
        print(f"error: {e}", file=sys.stderr)
        code = 1
    finally:
        print("\nstopping ...", flush=True)
        for p in reversed(started):
            rc = p.stop()
            print(f"  {p.name} stopped (exit code {rc})", flush=True)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
