"""The part of ``kustomize build`` the overlays in deploy/ use, offline and in Python.

Resources (files, or directories with a kustomization.yaml), ``namespace``, and
``patches`` given by ``path``: a strategic-merge patch (maps merge; lists of
named objects merge by ``name``, or ``mountPath`` for volume mounts, and the
patch's items, merged or new, come first in the patch's order, as kustomize puts
them) or ``$patch: delete``. Anything else
in a kustomization is refused, so an overlay cannot outgrow what its test
checks; where ``kubectl`` is installed a test compares this with
``kubectl kustomize``.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

Doc = dict[str, Any]
KNOWN_FIELDS = {"apiVersion", "kind", "namespace", "resources", "patches"}
MERGE_KEYS = {"volumeMounts": "mountPath"}  # else "name"


def _key(doc: Doc) -> tuple[str, str]:
    return doc["kind"], doc["metadata"]["name"]


def _merge_list(field: str, base: list[Any], patch: list[Any]) -> list[Any]:
    key = MERGE_KEYS.get(field, "name")
    if not all(isinstance(i, dict) and key in i for i in [*base, *patch]):
        return copy.deepcopy(patch)  # scalars, or unnamed objects: replaced
    by_key = {i[key]: i for i in base}
    patched = [merge(by_key[i[key]], i) if i[key] in by_key else copy.deepcopy(i) for i in patch]
    rest = [copy.deepcopy(b) for b in base if b[key] not in {i[key] for i in patch}]
    return patched + rest


def merge(base: Doc, patch: Doc) -> Doc:
    """``patch`` merged into a copy of ``base`` (strategic merge, the cases above)."""
    out = copy.deepcopy(base)
    for field, value in patch.items():
        if isinstance(value, dict) and isinstance(out.get(field), dict):
            out[field] = merge(out[field], value)
        elif isinstance(value, list) and isinstance(out.get(field), list):
            out[field] = _merge_list(field, out[field], value)
        else:
            out[field] = copy.deepcopy(value)
    return out


def render(directory: Path) -> list[Doc]:
    """The objects ``kubectl kustomize directory`` would print (in no particular order)."""
    kust = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(kust) - KNOWN_FIELDS
    if unknown:
        raise ValueError(f"{directory}: kustomization fields {sorted(unknown)} not rendered here")
    docs: list[Doc] = []
    for resource in kust.get("resources", []):
        path = directory / resource
        if path.is_dir():
            docs.extend(render(path))
        else:
            docs.extend(d for d in yaml.safe_load_all(path.read_text()) if d)
    objects = {_key(d): d for d in docs}
    assert len(objects) == len(docs), f"{directory}: an object is defined twice"
    for entry in kust.get("patches", []):
        if set(entry) != {"path"}:
            raise ValueError(f"{directory}: only patches given by path are rendered here")
        (patch,) = [d for d in yaml.safe_load_all((directory / entry["path"]).read_text()) if d]
        target = _key(patch)
        if target not in objects:
            raise ValueError(f"{entry['path']}: no {target[0]}/{target[1]} to patch")
        if patch.get("$patch") == "delete":
            del objects[target]
        else:
            objects[target] = merge(objects[target], patch)
    if "namespace" in kust:
        for d in objects.values():
            if d["kind"] != "Namespace":
                d["metadata"]["namespace"] = kust["namespace"]
    return list(objects.values())
