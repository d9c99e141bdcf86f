"""What the shipped PromQL reads: the dashboards' queries and the Prometheus rules.

A small reader, not a PromQL parser: it finds each series selector (a metric name
and the label names it matches on) and the label names of grouping clauses, which
is what a check against the services' real /metrics output needs. The queries are
also checked by promtool (rules) and by Grafana's own parser when provisioned.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tests.unit.deploy.helpers import DEPLOY

DASHBOARDS = DEPLOY / "grafana" / "dashboards"
RULES = DEPLOY / "prometheus" / "rules"

NAME = r"[A-Za-z_:][A-Za-z0-9_:]*"
KEYWORDS = frozenset(
    {"by", "without", "on", "ignoring", "group_left", "group_right", "bool"}
    | {"and", "or", "unless", "offset", "inf", "nan", "Inf", "NaN"}
)
# Grafana's built-in interval variables, as a duration; every other variable matches anything
GRAFANA_INTERVALS = ("__rate_interval", "__interval", "__range")

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_NUMBER = re.compile(r"(?<![\w:.])\d+(?:\.\d+)?(?:[eE][+-]?\d+)?\b")
_SELECTOR = re.compile(rf"({NAME})\s*(\{{[^}}]*\}})?")
_MATCHER = re.compile(rf"({NAME})\s*(?:=~|!~|!=|=)")
_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)|\[\[(\w+)\]\]")


@dataclass(frozen=True)
class Selector:
    metric: str
    labels: frozenset[str]  # label names the selector matches on


@dataclass(frozen=True)
class Query:
    where: str  # file and panel / rule, for messages
    expr: str  # variables substituted

    def selectors(self) -> list[Selector]:
        return selectors(self.expr)

    def grouping_labels(self) -> set[str]:
        return grouping_labels(self.expr)


def _unquote_labels(expr: str) -> str:
    """``expr`` with string values emptied (label values, regexes and format strings)."""
    return _STRING.sub('""', expr)


def selectors(expr: str) -> list[Selector]:
    """Every series selector of a PromQL expression, in order."""
    s = _unquote_labels(expr)
    s = re.sub(r"\[[^\]]*\]", " ", s)  # ranges and subqueries
    s = re.sub(r"\boffset\s+\S+", " ", s)
    s = _GROUPING.sub(" ", s)
    s = _NUMBER.sub(" ", s)
    out = []
    for m in _SELECTOR.finditer(s):
        name, matchers = m.group(1), m.group(2) or ""
        after = s[m.end() :].lstrip()
        if name in KEYWORDS or (not matchers and after.startswith("(")):
            continue  # a keyword or a function call
        out.append(Selector(name, frozenset(_MATCHER.findall(matchers))))
    return out


def grouping_labels(expr: str) -> set[str]:
    """Label names in by/without/on/ignoring/group_left/group_right clauses."""
    s = _unquote_labels(expr)
    return {lbl for _, labels in _GROUPING.findall(s) for lbl in re.findall(NAME, labels)}


def substitute(expr: str, defined: set[str]) -> str:
    """Grafana's template variables replaced: intervals by 5m, others by '.*'. A
    variable the dashboard does not define raises KeyError."""

    def sub(m: re.Match[str]) -> str:
        name = next(g for g in m.groups() if g)
        if name in GRAFANA_INTERVALS:
            return "5m"
        if name not in defined:
            raise KeyError(f"template variable ${name} is not defined")
        return ".*"

    return _VARIABLE.sub(sub, expr)


def dashboard_files() -> list[Path]:
    return sorted(DASHBOARDS.glob("*.json"))


def load_dashboard(path: Path) -> dict[str, Any]:
    doc = json.loads(path.read_text())
    assert isinstance(doc, dict)
    return doc


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, those inside collapsed rows included."""
    for p in dashboard.get("panels", []):
        yield p
        yield from p.get("panels", [])


def dashboard_queries(path: Path) -> list[Query]:
    """Every PromQL a dashboard runs: panel targets, template variable queries
    (``label_values(selector, label)``: the selector, with the label as a matcher)
    and annotation queries."""
    d = load_dashboard(path)
    variables = d.get("templating", {}).get("list", [])
    defined = {v["name"] for v in variables}
    out = []
    for p in panels(d):
        for t in p.get("targets", []):
            where = f"{path.name}: panel {p.get('title')!r} {t.get('refId')}"
            out.append(Query(where, substitute(t["expr"], defined)))
    for v in variables:
        if v.get("type") != "query":
            continue
        q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
        m = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", q.strip())
        assert m, f"{path.name}: variable {v['name']}: only label_values(selector, label) is read"
        sel, label = m.group(1), m.group(2)
        sel = sel + "{" + label + '!=""}' if "{" not in sel else sel[:-1] + f', {label}!=""}}'
        out.append(Query(f"{path.name}: variable ${v['name']}", substitute(sel, defined)))
    for a in d.get("annotations", {}).get("list", []):
        if a.get("expr"):
            where = f"{path.name}: annotation {a.get('name')!r}"
            out.append(Query(where, substitute(a["expr"], defined)))
    return out


def rule_files() -> list[Path]:
    return sorted(RULES.glob("*.yml"))


def rules() -> Iterator[tuple[Path, dict[str, Any]]]:
    for path in rule_files():
        for group in yaml.safe_load(path.read_text())["groups"]:
            for rule in group["rules"]:
                yield path, rule


def rule_queries() -> list[Query]:
    return [
        Query(f"{path.name}: {rule.get('record') or rule.get('alert')}", rule["expr"])
        for path, rule in rules()
    ]


def recorded() -> dict[str, set[str]]:
    """Recording rules' output names -> the labels they keep (their grouping labels)."""
    return {
        rule["record"]: grouping_labels(rule["expr"]) - {"le"}
        for _, rule in rules()
        if "record" in rule
    }
