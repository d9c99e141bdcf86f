"""Configuration: one YAML file, one section per service, env overrides.

Precedence, lowest first: dataclass defaults < YAML section < environment
(``LLM_<SECTION>_<FIELD>``, e.g. ``LLM_TOKENIZER_PORT=50061``) < explicit
overrides (command-line flags). The YAML file is ``$LLM_CONFIG`` when set,
else ``config/stack.yaml`` at the repository root.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import types
import typing
from collections.abc import Iterable, Iterator, Mapping
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
    """Fields every gRPC service has.

    Attributes:
        host: Address the gRPC server binds.
        port: gRPC port (0 = an ephemeral port).
        metrics_port: Prometheus ``/metrics`` port (0 = an ephemeral port, -1 = no
            metrics endpoint).
        grace_seconds: On SIGTERM, how long calls in flight get to finish.
        log_level: ``debug``, ``info``, ``warning`` or ``error``.
        log_format: ``auto`` (JSON unless stderr is a TTY), ``json`` or ``console``.
        port_file: Where to write the bound ports as JSON once serving, for
            supervisors ("" = nowhere).
        service_token_file: File with the shared secret of internal calls
            (``common.service_auth``): engines and tokenizers require it, the gateway
            sends it ("" = open; development and tests only).
        max_message_bytes: Largest gRPC message accepted or sent; a bigger request is
            RESOURCE_EXHAUSTED before any handler runs.
        reuse_port: Share the listening ports with sibling processes (SO_REUSEPORT);
            set by a supervisor for its workers; off otherwise, so a second process on
            a taken port fails to start.
        otlp_protocol: How traces and metrics go to the OTLP endpoint (set by the
            standard ``OTEL_EXPORTER_OTLP_ENDPOINT``): ``grpc`` or ``"http/protobuf"``
            ("" = the standard ``OTEL_EXPORTER_OTLP_PROTOCOL``, else ``grpc``).
    """

    host: str = "127.0.0.1"
    port: int = 0
    metrics_port: int = 0
    grace_seconds: float = 10.0
    log_level: str = "info"
    log_format: str = "auto"
    port_file: str = ""
    service_token_file: str = ""
    max_message_bytes: int = 4 * 1024 * 1024
    reuse_port: bool = False
    otlp_protocol: str = ""


C = TypeVar("C")

log = logging.getLogger(__name__)

# field metadata keys (set through ``deprecated_flat_names`` and ``NOT_A_KEY``)
_CONFIG_KEY = "config_key"
_FLAT_NAMES = "deprecated_flat_names"

NOT_A_KEY: Mapping[str, Any] = types.MappingProxyType({_CONFIG_KEY: False})
"""Field metadata of a field the loader never reads (the program derives it)."""


def deprecated_flat_names(prefix: str, knobs: Iterable[str] | None = None) -> Mapping[str, Any]:
    """Field metadata of a sub-section whose knobs (``knobs``, default all) used to be
    flat keys of the parent section named ``<prefix><knob>``: those names are still read
    (YAML and env), with a warning naming the new key.

    A field whose type is a dataclass is a sub-section: ``<section>.<field>.<knob>`` in
    YAML, ``LLM_<SECTION>_<FIELD>_<KNOB>`` in the environment.
    """
    only = None if knobs is None else tuple(knobs)
    return types.MappingProxyType({_FLAT_NAMES: (prefix, only)})


def _flat_names(field: dataclasses.Field[Any], sub: type) -> dict[str, str]:
    """Old flat name -> knob, for a sub-section field declared with
    ``deprecated_flat_names`` (empty otherwise)."""
    if _FLAT_NAMES not in field.metadata:
        return {}
    prefix, only = field.metadata[_FLAT_NAMES]
    return {prefix + k: k for k in _fields(sub) if only is None or k in only}


@dataclasses.dataclass(frozen=True, slots=True)
class ConfigKey:
    """One key a config class reads: ``path`` is dotted below the section."""

    path: str
    env: str
    type: Any
    field: dataclasses.Field[Any]
    owner: type


def config_keys(cls: type, section: str) -> list[ConfigKey]:
    """Every key of ``cls`` loaded as ``section``, nested sub-sections flattened, in
    declaration order."""
    return list(_walk(cls, "", f"LLM_{section.upper()}_"))


def deprecated_flat_renames(cls: type, section: str) -> list[tuple[str, ConfigKey]]:
    """``(old flat name, the key that replaced it)`` for each knob of the sub-sections of
    ``cls`` declared with ``deprecated_flat_names``."""
    keys = {k.path: k for k in config_keys(cls, section)}
    hints = typing.get_type_hints(cls)
    return [
        (old, keys[f"{f.name}.{knob}"])
        for f in _fields(cls).values()
        if _is_section(hints[f.name])
        for old, knob in _flat_names(f, hints[f.name]).items()
    ]


def _walk(cls: type, path: str, env_prefix: str) -> Iterator[ConfigKey]:
    hints = typing.get_type_hints(cls)
    for f in _fields(cls).values():
        tp = hints[f.name]
        if _is_section(tp):
            yield from _walk(tp, f"{path}{f.name}.", f"{env_prefix}{f.name.upper()}_")
        else:
            yield ConfigKey(path + f.name, env_prefix + f.name.upper(), tp, f, cls)


def _fields(cls: type) -> dict[str, dataclasses.Field[Any]]:
    return {
        f.name: f for f in dataclasses.fields(cls) if f.metadata.get(_CONFIG_KEY, True) and f.init
    }


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


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

    A field whose type is a dataclass is a nested section: a mapping in YAML, env vars
    ``LLM_<SECTION>_<FIELD>_<KNOB>``, and in ``overrides`` a mapping or dotted
    ``"<field>.<knob>"`` names.

    Raises:
        ValueError: unknown keys, or values of the wrong type, naming the key.
    """
    env = os.environ if env is None else env
    cfg_path = Path(path or env.get("LLM_CONFIG") or DEFAULT_CONFIG_PATH)
    data: Any = {}
    if cfg_path.exists():
        doc = yaml.safe_load(cfg_path.read_text()) or {}
        if not isinstance(doc, dict):
            raise ValueError(f"{cfg_path}: expected a mapping of sections at the top level")
        data = doc.get(section) or {}
    elif path is not None:
        raise ValueError(f"config file {cfg_path} does not exist")
    loader = _Loader(cfg_path, env)
    built: C = loader.build(cls, section, data, f"LLM_{section.upper()}_", overrides or {})
    return built


@dataclasses.dataclass(slots=True)
class _Loader:
    source: Path
    env: Mapping[str, str]

    def build(
        self,
        cls: type[C],
        where: str,
        data: Any,
        env_prefix: str,
        overrides: Mapping[str, Any],
    ) -> C:
        if not isinstance(data, dict):
            raise ValueError(f"{self.source} [{where}]: expected a mapping, got {data!r}")
        hints = typing.get_type_hints(cls)
        fields = _fields(cls)
        data = dict(data)
        subs = {n: hints[n] for n in fields if _is_section(hints[n])}
        for name in subs:
            self._read_flat_names(where, data, env_prefix, name, fields[name], subs[name])
        env_values = {
            n: self.env[env_prefix + n.upper()]
            for n in fields
            if n not in subs and env_prefix + n.upper() in self.env
        }
        unknown = sorted(set(data) - set(fields))
        if unknown:
            raise ValueError(
                f"{self.source} [{where}]: unknown key(s) {unknown}; valid keys: {sorted(fields)}"
            )
        nested_overrides, overrides = _split_overrides(overrides, subs, where)
        values: dict[str, Any] = {**data, **env_values}
        for name, value in overrides.items():
            if name not in fields:
                raise ValueError(f"unknown option {name!r} for [{where}]")
            if value is not None:
                values[name] = value
        kwargs: dict[str, Any] = {}
        for name, raw in values.items():
            if name not in subs:
                kwargs[name] = _coerce(raw, hints[name], f"[{where}] {name}")
        for name, sub in subs.items():
            kwargs[name] = self.build(
                sub,
                f"{where}.{name}",
                data.get(name) or {},
                f"{env_prefix}{name.upper()}_",
                nested_overrides.get(name, {}),
            )
        return cls(**kwargs)

    def _read_flat_names(
        self,
        where: str,
        data: dict[str, Any],
        env_prefix: str,
        name: str,
        field: dataclasses.Field[Any],
        sub: type,
    ) -> None:
        """Move the deprecated flat names of sub-section ``name``'s knobs (YAML keys and
        env vars) to where the new names are read, warning about each one."""
        renames = _flat_names(field, sub)
        nested = data.get(name) or {}
        if not renames or not isinstance(nested, dict):
            return  # build() reports a nested value that is not a mapping
        nested = data[name] = dict(nested)
        for old, knob in renames.items():
            new = f"{where}.{name}.{knob}"
            new_env = f"{env_prefix}{name.upper()}_{knob.upper()}"
            if old in data:
                if knob in nested:
                    raise ValueError(
                        f"{self.source} [{where}]: both {old} and {name}.{knob} are set; "
                        f"keep only {new}"
                    )
                nested[knob] = data.pop(old)
                _warn_renamed(f"{where}.{old}", new, f"{self.source}")
            old_env = env_prefix + old.upper()
            if old_env != new_env and old_env in self.env:
                if new_env in self.env:
                    raise ValueError(f"both {old_env} and {new_env} are set; keep only {new_env}")
                self.env = {**self.env, new_env: self.env[old_env]}
                _warn_renamed(old_env, new_env, "the environment")


def _warn_renamed(old: str, new: str, where: str) -> None:
    log.warning(
        "config: %s (in %s) is deprecated and read for this release only; use %s",
        old,
        where,
        new,
    )


def _split_overrides(
    overrides: Mapping[str, Any], subs: Mapping[str, type], where: str
) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """Overrides of sub-sections (a mapping, or dotted names) apart from the others."""
    nested: dict[str, dict[str, Any]] = {name: {} for name in subs}
    flat: dict[str, Any] = {}
    for key, value in overrides.items():
        head, dot, rest = key.partition(".")
        if dot and head in subs:
            nested[head][rest] = value
        elif key in subs:
            if value is not None:
                if not isinstance(value, Mapping):
                    raise ValueError(f"option {key!r} for [{where}] must be a mapping")
                nested[key].update(value)
        else:
            flat[key] = value
    return nested, flat


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
