"""Alert and recording rules (deploy/prometheus/rules): promtool checks them and runs
their unit tests (deploy/prometheus/tests), every alert is tested firing and quiet,
and both Prometheus configs load them.

promtool comes from `make promtool` (Debian's prometheus package unpacked into
.cache/tools, no root), ``$PROMTOOL``, or PATH. Without it these tests fail under
CI=true and are skipped elsewhere, saying what to install.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from common.config import ROOT
from tests.unit.deploy.helpers import DEPLOY, require_tool
from tests.unit.deploy.promql import RULES, recorded, rule_files, rules

PROMETHEUS = DEPLOY / "prometheus"
RULE_TESTS = sorted((PROMETHEUS / "tests").glob("*.test.yml"))
SEVERITIES = {"critical", "warning", "info"}


def find_promtool() -> str | None:
    for candidate in (
        os.environ.get("PROMTOOL", ""),
        str(ROOT / ".cache" / "tools" / "prometheus" / "usr" / "bin" / "promtool"),
    ):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return shutil.which("promtool")


@pytest.fixture(scope="module")
def promtool() -> str:
    return require_tool(
        "promtool",
        "run `make promtool` (Debian's prometheus package, unpacked without root), install "
        "the 'prometheus' package, or set $PROMTOOL",
        found=find_promtool(),
    )


def run(promtool: str, *args: str | Path, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [promtool, *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=120
    )


def alert_names() -> set[str]:
    return {rule["alert"] for _, rule in rules() if "alert" in rule}


def rule_tests() -> list[dict[str, Any]]:
    return [t for path in RULE_TESTS for t in yaml.safe_load(path.read_text())["tests"]]


def test_rules_pass_promtool_check(promtool: str) -> None:
    out = run(promtool, "check", "rules", *rule_files())
    assert out.returncode == 0, out.stdout + out.stderr
    assert len(rule_files()) >= 2


def test_compose_config_loads_the_rules(promtool: str) -> None:
    # prometheus-k8s.yml cannot be checked this way: Debian's promtool is built
    # without Kubernetes service discovery (test_configs_name_the_rule_files covers it)
    out = run(promtool, "check", "config", PROMETHEUS / "prometheus.yml")
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(rule_files())} rule files found" in out.stdout


def test_rule_unit_tests_pass(promtool: str) -> None:
    assert RULE_TESTS
    out = run(promtool, "test", "rules", *RULE_TESTS)
    assert out.returncode == 0, out.stdout + out.stderr


def test_rule_unit_tests_catch_a_changed_threshold(promtool: str, tmp_path: Path) -> None:
    """The unit tests are a real check: a KV alert at 50 % instead of 95 % fails them."""
    shutil.copytree(PROMETHEUS / "rules", tmp_path / "rules")
    shutil.copytree(PROMETHEUS / "tests", tmp_path / "tests")
    path = tmp_path / "rules" / "llm-alerts.yml"
    text = path.read_text()
    assert "(engine_kv_cache_usage_perc) > 0.95" in text
    path.write_text(
        text.replace("(engine_kv_cache_usage_perc) > 0.95", "(engine_kv_cache_usage_perc) > 0.5")
    )
    out = run(promtool, "test", "rules", "tests/llm-alerts.test.yml", cwd=tmp_path)
    assert out.returncode != 0
    assert "LLMKVCacheNearlyFull" in out.stdout + out.stderr


def test_every_alert_is_tested_firing_and_quiet() -> None:
    firing: set[str] = set()
    quiet: set[str] = set()
    for test in rule_tests():
        for case in test.get("alert_rule_test", []):
            (firing if case.get("exp_alerts") else quiet).add(case["alertname"])
    names = alert_names()
    # promtool passes a test of an alert name that no rule has, with no alerts expected
    assert (firing | quiet) <= names, f"tests of unknown alerts: {(firing | quiet) - names}"
    assert not names - firing, f"never tested firing: {sorted(names - firing)}"
    assert not names - quiet, f"never tested quiet: {sorted(names - quiet)}"


def test_every_recording_rule_is_tested_or_alerted_on() -> None:
    tested = " ".join(
        case["expr"] for test in rule_tests() for case in test.get("promql_expr_test", [])
    )
    alert_exprs = " ".join(rule["expr"] for _, rule in rules() if "alert" in rule)
    for name in recorded():
        assert name in tested or name in alert_exprs, name


def test_alerts_say_how_bad_and_where_to_read_more() -> None:
    sections = set(re.findall(r"^## (\d+)\.", (ROOT / "docs" / "operations.md").read_text(), re.M))
    for path, rule in rules():
        if "alert" not in rule:
            continue
        where = f"{path.name}: {rule['alert']}"
        assert rule["alert"].startswith("LLM"), where
        assert rule["labels"]["severity"] in SEVERITIES, where
        ann = rule["annotations"]
        assert ann["summary"], where
        assert ann["description"], where
        m = re.fullmatch(r"docs/operations\.md section (\d+)", ann["runbook"])
        assert m, f"{where}: runbook {ann['runbook']!r}"
        assert m.group(1) in sections, f"{where}: runbook {ann['runbook']!r}"


def test_alert_and_record_names_are_unique() -> None:
    names = [rule.get("alert") or rule["record"] for _, rule in rules()]
    assert len(names) == len(set(names))


@pytest.mark.parametrize("config", ["prometheus.yml", "prometheus-k8s.yml"])
def test_configs_name_the_rule_files(config: str) -> None:
    doc = yaml.safe_load((PROMETHEUS / config).read_text())
    found = {p for pattern in doc["rule_files"] for p in PROMETHEUS.glob(pattern)}
    assert found == set(rule_files())


def test_compose_mounts_the_rules_beside_the_config() -> None:
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    prom = compose["services"]["prometheus"]
    mounts = {v.split(":")[0]: v.split(":")[1] for v in prom["volumes"]}
    config = next(a.split("=", 1)[1] for a in prom["command"] if a.startswith("--config.file="))
    assert mounts["./prometheus/prometheus.yml"] == config
    assert Path(mounts["./prometheus/rules"]) == Path(config).parent / "rules"
    assert (DEPLOY / "prometheus" / "rules") == RULES
