"""Configuration: one YAML file, one section per service, env overrides.

Precedence, lowest first: dataclass defaults < YAML section < environment
(``LLM_<SECTION>_<FIELD>``, e.g. ``LLM_TOKENIZER_PORT=50061``) < explicit
overrides (command-line flags). The YAML file is ``$LLM_CONFIG`` when set,
else ``config/stack.yaml`` at the repository root.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG_PATH = ROOT / "config" / "stack.yaml"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def cache_dir() -> Path:
    """Where prepared models live: ``$LLM_CACHE_DIR`` or ``.cache/`` in the repo."""
    return Path(os.environ.get("LLM_CACHE_DIR", ROOT / ".cache")).resolve()


def default_model_dir() -> Path:
    """The prepared HF checkpoint: ``$LLM_MODEL_DIR`` or ``<cache>/models/<name>``."""
    env = os.environ.get("LLM_MODEL_DIR")
    if env:
        return Path(env).resolve()
    return cache_dir() / "models" / DEFAULT_MODEL_NAME


@dataclasses.dataclass(slots=True)
class ServiceConfig:
    """Fields every gRPC service has."""

    host: str = "127.0.0.1"
    port: int = 0
    metrics_port: int = 0  # 0 = an ephemeral port, -1 = no metrics endpoint
    grace_seconds: float = 10.0
    log_level: str = "info"
    log_format: str = "auto"  # auto (JSON unless a TTY) | json | console
    port_file: str = ""  # where to write the bound ports as JSON (for supervisors)
    # the shared secret of internal calls (common/service_auth.py): engines and tokenizers
    # require it, the gateway sends it; "" = open (development and tests only)
    service_token_file: str = ""
    # largest gRPC message accepted or sent; a bigger request is RESOURCE_EXHAUSTED before
    # any handler runs (a prompt of the largest context is well under 1 MiB)
    max_message_bytes: int = 4 * 1024 * 1024
    # share the listening ports with sibling processes (SO_REUSEPORT): set by a supervisor
    # for its workers; off otherwise, so a second process on a taken port fails to start
    reuse_port: bool = False


C = TypeVar("C")


def _coerce(raw: Any, tp: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (types.UnionType, typing.Union):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if raw is None or (isinstance(raw, str) and raw.lower() in ("", "none", "null")):
            return None
        return _coerce(raw, args[0], where)
    if origin is list:
        (item,) = typing.get_args(tp)
        items = raw.split(",") if isinstance(raw, str) else list(raw)
        return [
            _coerce(i.strip() if isinstance(i, str) else i, item, where) for i in items if i != ""
        ]
    if tp is bool:
        if isinstance(raw, bool):
            return raw
        s = str(raw).strip().lower()
        if s in ("1", "true", "yes", "on"):
            return True
        if s in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{where}: expected a boolean (true/false), got {raw!r}")
    if tp in (int, float, str):
        try:
            return tp(raw)
        except (TypeError, ValueError):
            raise ValueError(f"{where}: expected {tp.__name__}, got {raw!r}") from None
    return raw


def load_config(
    cls: type[C],
    section: str,
    *,
    path: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> C:
    """Build ``cls`` (a dataclass) from defaults, the YAML section, env and overrides.

    Raises:
        ValueError: unknown keys, or values of the wrong type, naming the key.
    """
    env = os.environ if env is None else env
    cfg_path = Path(path or env.get("LLM_CONFIG") or DEFAULT_CONFIG_PATH)
    data: dict[str, Any] = {}
    if cfg_path.exists():
        doc = yaml.safe_load(cfg_path.read_text()) or {}
        if not isinstance(doc, dict):
            raise ValueError(f"{cfg_path}: expected a mapping of sections at the top level")
        data = dict(doc.get(section) or {})
    elif path is not None:
        raise ValueError(f"config file {cfg_path} does not exist")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    unknown = sorted(set(data) - set(names))
    if unknown:
        raise ValueError(
            f"{cfg_path} [{section}]: unknown key(s) {unknown}; valid keys: {sorted(names)}"
        )
    prefix = f"LLM_{section.upper()}_"
    for name in names:
        key = prefix + name.upper()
        if key in env:
            data[name] = env[key]
    for name, value in (overrides or {}).items():
        if name not in names:
            raise ValueError(f"unknown option {name!r} for [{section}]")
        if value is not None:
            data[name] = value
    kwargs = {k: _coerce(v, hints[k], f"[{section}] {k}") for k, v in data.items()}
    return cls(**kwargs)


def add_service_args(parser: Any) -> None:
    """Flags every service accepts; they override the YAML file and env."""
    parser.add_argument(
        "--config", help="YAML config file (default $LLM_CONFIG or config/stack.yaml)"
    )
    parser.add_argument("--host")
    parser.add_argument("--port", type=int)
    parser.add_argument("--metrics-port", type=int, help="0 = ephemeral, -1 = off")
    parser.add_argument("--port-file", help="write bound ports here as JSON once serving")
    parser.add_argument("--log-level")
    parser.add_argument("--log-format", choices=["auto", "json", "console"])
    parser.add_argument(
        "--service-token-file", help="file with the shared secret of internal calls"
    )


def service_overrides(args: Any) -> dict[str, Any]:
    """The common flags of ``add_service_args`` as config overrides."""
    return {
        "host": args.host,
        "port": args.port,
        "metrics_port": args.metrics_port,
        "port_file": args.port_file,
        "log_level": args.log_level,
        "log_format": args.log_format,
        "service_token_file": args.service_token_file,
    }
