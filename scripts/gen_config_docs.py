"""Write docs/configuration.md from the config dataclasses: every key of every section,
with its type, default, environment variable and meaning.

A key's meaning is its entry in the ``Attributes:`` section of its dataclass's docstring
(or of a base class's, for inherited keys): the one place a key is documented.

    python -m scripts.gen_config_docs          # rewrite docs/configuration.md
    python -m scripts.gen_config_docs --check  # exit 1 when it is out of date
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any

from common.config import ROOT, ConfigKey, config_keys, deprecated_flat_renames
from deploy.envoy.config import EnvoyConfig
from engine_svc.config import EngineServiceConfig
from engine_svc.core.config import EngineConfig
from gateway.config import GatewayConfig
from ratelimit.config import RateLimitConfig
from tokenizer_svc.config import TokenizerConfig

DOC_PATH = ROOT / "docs" / "configuration.md"
REGENERATE = "make config-docs"

# section -> (config class, who reads it), in the order of config/stack.yaml
SECTIONS: dict[str, tuple[type, str]] = {
    "tokenizer": (TokenizerConfig, "`python -m tokenizer_svc`"),
    "engine": (EngineServiceConfig, "`python -m engine_svc`"),
    "engine_core": (EngineConfig, "the engine inside `python -m engine_svc`"),
    "ratelimit": (RateLimitConfig, "the gateway and `python -m ratelimit`"),
    "gateway": (GatewayConfig, "`python -m gateway`"),
    "envoy": (EnvoyConfig, "`make run`'s Envoy (`deploy/envoy`)"),
}

_ENTRY = re.compile(r"^(?P<names>[a-z_][a-z0-9_]*(?:\s*/\s*[a-z_][a-z0-9_]*)*):\s*(?P<text>.*)$")


def attribute_docs(cls: type) -> dict[str, str]:
    """The ``Attributes:`` entries of ``cls``'s docstring, one paragraph per name
    (``a / b: text`` documents both)."""
    lines = inspect.cleandoc(cls.__dict__.get("__doc__") or "").splitlines()
    docs: dict[str, str] = {}
    try:
        start = lines.index("Attributes:") + 1
    except ValueError:
        return docs
    names: list[str] = []
    indent = None
    for line in lines[start:]:
        if line.strip() and not line.startswith(" "):
            break  # the next section
        if not line.strip():
            continue
        depth = len(line) - len(line.lstrip())
        indent = depth if indent is None else indent
        m = _ENTRY.match(line.strip())
        if depth == indent and m:
            names = [n.strip() for n in m["names"].split("/")]
            for n in names:
                docs[n] = m["text"]
        else:
            for n in names:
                docs[n] = f"{docs[n]} {line.strip()}"
    return docs


def key_doc(key: ConfigKey) -> str:
    """The key's meaning from the first class in its owner's MRO that documents it."""
    for klass in key.owner.__mro__:
        doc = attribute_docs(klass).get(key.field.name)
        if doc:
            return doc
    raise ValueError(
        f"{key.owner.__qualname__}.{key.field.name} has no entry in an Attributes: "
        "section of its class's docstring (or a base class's)"
    )


def type_name(tp: Any) -> str:
    """``int``, ``list of str``, ``mapping``, ``int or null``."""
    origin = typing.get_origin(tp)
    if origin in (types.UnionType, typing.Union):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return f"{type_name(args[0])} or null"
    if origin is list:
        return f"list of {type_name(typing.get_args(tp)[0])}"
    if origin is dict:
        return "mapping"
    return str(getattr(tp, "__name__", tp))


def default_of(field: dataclasses.Field[Any]) -> str:
    """The default as YAML would write it."""
    if field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        value = field.default
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    return json.dumps(value, sort_keys=True) if isinstance(value, list | dict) else repr(value)


def _cell(text: str) -> str:
    """Docstring markup as Markdown, safe inside a table cell."""
    return text.replace("``", "`").replace("|", "\\|")


def _table(keys: list[ConfigKey], strip: str) -> list[str]:
    rows = [
        "| Key | Type | Default | Environment | Meaning |",
        "|---|---|---|---|---|",
    ]
    for k in keys:
        rows.append(
            f"| `{k.path.removeprefix(strip)}` | {type_name(k.type)} | "
            f"`{default_of(k.field)}` | `{k.env}` | {_cell(key_doc(k))} |"
        )
    return rows


def _summary(cls: type) -> str:
    doc = inspect.cleandoc(cls.__dict__.get("__doc__") or "")
    return _cell(" ".join(doc.split("\n\n")[0].split()))


def render_section(section: str, cls: type, reader: str) -> list[str]:
    """The Markdown of one section: its own keys, then one table per sub-section."""
    keys = config_keys(cls, section)
    out = [f"## `{section}`", "", f"{_summary(cls)} Read by {reader}.", ""]
    out += _table([k for k in keys if "." not in k.path], "")
    subs: dict[str, list[ConfigKey]] = {}
    for k in keys:
        if "." in k.path:
            subs.setdefault(k.path.rsplit(".", 1)[0], []).append(k)
    for sub, sub_keys in subs.items():
        owner = sub_keys[0].owner
        out += ["", f"### `{section}.{sub}`", "", _summary(owner), ""]
        out += _table(sub_keys, f"{sub}.")
    return [*out, ""]


def render_renames() -> list[str]:
    """The table of deprecated flat names and the keys that replace them."""
    rows = [
        "| Old name (read for this release, with a warning) | New key | New environment |",
        "|---|---|---|",
    ]
    for section, (cls, _) in SECTIONS.items():
        for old, key in deprecated_flat_renames(cls, section):
            old_env = f"LLM_{section.upper()}_{old.upper()}"
            same = " (unchanged)" if old_env == key.env else f" (was `{old_env}`)"
            rows.append(f"| `{section}.{old}` | `{section}.{key.path}` | `{key.env}`{same} |")
    return rows


def render() -> str:
    """The whole page."""
    out = [
        "# Configuration",
        "",
        "<!-- Generated by scripts/gen_config_docs.py from the config classes; "
        f"edit their docstrings, then run `{REGENERATE}`. -->",
        "",
        "One YAML file configures the whole stack: `config/stack.yaml`, or the file named "
        "by `$LLM_CONFIG`. It has one section per service; a service reads its own section "
        "and ignores the others. A value is taken from, lowest first:",
        "",
        "1. the default below;",
        "2. the YAML file;",
        "3. the environment: `LLM_<SECTION>_<KEY>` (e.g. `LLM_TOKENIZER_PORT=50061`), and for "
        "a key of a sub-section `LLM_<SECTION>_<SUB>_<KEY>` "
        "(e.g. `LLM_ENGINE_CORE_SCHEDULER_MAX_NUM_SEQS=64`);",
        "4. the service's command-line flags (`--port`, `--config`, ...).",
        "",
        "A sub-section is a mapping inside its section (`engine_core.scheduler`, "
        "`gateway.breaker`). In the environment a boolean is `true`/`false` (also "
        "`1`/`0`, `yes`/`no`, `on`/`off`), a list is comma-separated, and a mapping is a "
        "YAML or JSON string. An unknown key, or a value of the wrong type, stops the "
        "service at start with an error naming the section and the key.",
        "",
    ]
    for section, (cls, reader) in SECTIONS.items():
        out += render_section(section, cls, reader)
    out += [
        "## Renamed keys",
        "",
        "These keys moved into sub-sections. The old names are still read for this "
        "release, each with a warning in the log naming the new key; setting an old name "
        "and its new name together is an error. They go in the next release.",
        "",
        *render_renames(),
        "",
    ]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the page is stale")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not DOC_PATH.exists() or DOC_PATH.read_text() != text:
            print(f"{DOC_PATH} is out of date: run `{REGENERATE}`", file=sys.stderr)
            return 1
        return 0
    DOC_PATH.write_text(text)
    print(f"wrote {Path(DOC_PATH).relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
