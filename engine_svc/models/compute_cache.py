"""Start-up measurements kept on disk, so a restart on the same machine skips them.

At start the engine times its candidate dtypes on a copy of the model
(``path_choice``), its loaded projections (``linear.tune_linears``) and its
prefill attention (``attention.choose_prefill_*``): tens of seconds on a quiet
2-core machine, minutes on a busy one. What they decide is a handful of values
(``Decision``); this module keeps them in one JSON file per key, where the key
hashes everything the decision depends on:

- the model's ``config.json`` (shapes, not weights);
- the engine settings that change what is timed (dtype, quantization, the
  4-bit copies, KV dtype, block size, batch limits, CPU tier cap, threads);
- the machine: CPU model and flags, torch version and its ISA caps
  (``ATEN_CPU_CAPABILITY``, ``ONEDNN_MAX_CPU_ISA``);
- the code that measures and runs (the sources of ``engine_svc/models``), so a
  new kernel or threshold rule measures again.

A file that cannot be read or does not fit is ignored and measured over. Writes
are atomic (a temporary file renamed into place), so engines starting side by
side never read half a file.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import platform
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

FORMAT = 1
_CODE_DIR = Path(__file__).resolve().parent


def default_dir() -> Path:
    """``$XDG_CACHE_HOME/llm-serving-stack/compute`` (``~/.cache`` when unset)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "llm-serving-stack" / "compute"


def resolve_dir(setting: str) -> Path | None:
    """The config value as a directory: ``auto`` = ``default_dir()``, ``""`` = no cache."""
    if not setting:
        return None
    return default_dir() if setting == "auto" else Path(setting).expanduser()


@dataclass(slots=True)
class Decision:
    """What the start-up measurements decided (the values the engine applies).

    Attributes:
        dtype: weight dtype name (``float32`` / ``bfloat16`` / ...).
        reason: how the dtype was chosen (``benchmark``, ``forced``, ...).
        detail: the measured candidates, in words.
        packing: prepacked copies above the few-row threshold (``""`` = dense).
        skinny_max_rows: few-row threshold of projections without a 4- or 8-bit copy.
        q4_max_rows: few-row threshold of projections with a 4-bit copy.
        prefill_attn_dtype: dtype name of causal prefill attention (``""`` = the
            model's attention dtype).
        prefill_fused: the fused prefill kernel serves fresh prompts.
        measured_at: when (Unix time) the measurements ran.
        load_average: the 1-minute load average when they ran (a busy machine's
            choice is measured again once the machine is quiet: ``remeasure``).
        q8_max_rows: few-row threshold of projections with an 8-bit copy.
    """

    dtype: str
    reason: str
    detail: str = ""
    packing: str = ""
    skinny_max_rows: int = 0
    q4_max_rows: int = 0
    prefill_attn_dtype: str = ""
    prefill_fused: bool = False
    measured_at: float = 0.0
    load_average: float = 0.0
    q8_max_rows: int = 0


def _code_digest() -> str:
    h = hashlib.sha256()
    for path in sorted(_CODE_DIR.rglob("*")):
        if path.is_file() and path.suffix in {".py", ".cpp", ".h", ".hpp", ".c"}:
            h.update(path.relative_to(_CODE_DIR).as_posix().encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def _cpu() -> dict[str, str]:
    facts = {"machine": platform.machine(), "model": "", "flags": ""}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and not facts["model"]:
                facts["model"] = value.strip()
            elif key in ("flags", "Features") and not facts["flags"]:
                facts["flags"] = " ".join(sorted(value.split()))
            if facts["model"] and facts["flags"]:
                break
    except OSError:
        facts["model"] = platform.processor()
    return facts


def cache_key(model_dir: str, settings: Mapping[str, object]) -> str:
    """The hash of everything a decision depends on (see the module doc)."""
    try:
        model_config = (Path(model_dir) / "config.json").read_text()
    except OSError:
        model_config = ""
    parts = {
        "format": FORMAT,
        "model_config": model_config,
        "settings": dict(settings),
        "cpu": _cpu(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "caps": {k: os.environ.get(k, "") for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")},
        "code": _code_digest(),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def remeasure(decision: Decision, load_now: float, cpus: int) -> bool:
    """Whether a stored decision should be measured again on this start.

    Timings taken while more threads wanted the CPUs than there were CPUs can
    pick a path that is only best under that contention (fewer packed weights,
    another dtype); such a decision is still applied while the machine stays
    that busy, but a start on a machine at most half as loaded, and not
    oversubscribed, measures again and replaces it.
    """
    busy_then = decision.load_average > cpus
    return busy_then and load_now <= cpus and load_now < decision.load_average / 2


def load_average() -> float:
    """The 1-minute load average (0 where the platform has none)."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0


class ComputeCache:
    """One directory of decisions, a file per key."""

    def __init__(self, directory: Path, key: str) -> None:
        self.directory = directory
        self.path = directory / f"{key[:32]}.json"

    def load(self) -> Decision | None:
        """The stored decision, or None (none stored, or a file that does not fit)."""
        try:
            raw = json.loads(self.path.read_text())
            if raw.pop("format", None) != FORMAT:
                return None
            return Decision(**raw)
        except FileNotFoundError:
            return None
        except (OSError, ValueError, TypeError) as e:
            logger.warning("compute cache %s unreadable (%s): measuring again", self.path, e)
            return None

    def store(self, decision: Decision) -> None:
        """Write ``decision`` atomically; a failure is logged, never raised (the engine
        runs with what it measured either way)."""
        if not decision.measured_at:
            decision.measured_at = time.time()
            decision.load_average = load_average()
        body = json.dumps({"format": FORMAT, **dataclasses.asdict(decision)}, indent=1)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".tmp-", suffix=".json")
            with os.fdopen(fd, "w") as f:
                f.write(body)
            os.replace(tmp, self.path)
        except OSError as e:
            logger.warning("compute cache %s not written: %s", self.path, e)
