"""Raven's Prometheus rules (deploy/prometheus/rules/): promtool accepts them, their unit tests pass, every alert
is tested both firing and not firing, and the PrometheusRule carries exactly the rules of the plain file."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.paths import ROOT

RULES = ROOT / "deploy" / "prometheus" / "rules"
SOURCE = RULES / "raven.rules.yaml"
OPERATOR = RULES / "raven.prometheusrule.yaml"
UNIT_TESTS = sorted((RULES / "tests").glob("*.yaml"))
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed (Debian package prometheus)")


def promtool(*args: str, cwd: Path = RULES) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=60, cwd=cwd, check=False)


def source_groups() -> list[dict[str, Any]]:
    groups: list[dict[str, Any]] = yaml.safe_load(SOURCE.read_text())["groups"]
    return groups


def alerts() -> list[str]:
    return [r["alert"] for g in source_groups() for r in g["rules"] if "alert" in r]


@needs_promtool
def test_promtool_check_rules() -> None:
    out = promtool("check", "rules", str(SOURCE))
    assert out.returncode == 0, out.stdout + out.stderr
    count = sum(len(g["rules"]) for g in source_groups())
    assert f"SUCCESS: {count} rules found" in out.stdout


@needs_promtool
def test_prometheusrule_spec_passes_promtool(tmp_path: Path) -> None:
    doc = yaml.safe_load(OPERATOR.read_text())
    extracted = tmp_path / "from-prometheusrule.yaml"
    extracted.write_text(yaml.safe_dump({"groups": doc["spec"]["groups"]}))
    out = promtool("check", "rules", str(extracted))
    assert out.returncode == 0, out.stdout + out.stderr


def test_prometheusrule_equals_the_rule_file() -> None:
    doc = yaml.safe_load(OPERATOR.read_text())
    assert doc["apiVersion"] == "monitoring.coreos.com/v1" and doc["kind"] == "PrometheusRule"
    assert doc["metadata"]["name"] and doc["metadata"]["labels"]
    assert doc["spec"]["groups"] == source_groups()
    generated = subprocess.run([sys.executable, str(RULES / "generate.py"), "--check"], capture_output=True,
                               text=True, timeout=60, check=False)
    assert generated.returncode == 0, generated.stderr


@needs_promtool
@pytest.mark.parametrize("path", UNIT_TESTS, ids=lambda p: p.name)
def test_promtool_unit_tests(path: Path) -> None:
    out = promtool("test", "rules", path.name, cwd=path.parent)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


def test_every_alert_is_tested_firing_and_not_firing() -> None:
    firing: set[str] = set()
    silent: set[str] = set()
    for path in UNIT_TESTS:
        doc = yaml.safe_load(path.read_text())
        assert doc["rule_files"] == ["../raven.rules.yaml"], path.name
        for test in doc["tests"]:
            for case in test.get("alert_rule_test", []):
                (firing if case.get("exp_alerts") else silent).add(case["alertname"])
                for alert in case.get("exp_alerts") or []:
                    # The annotations are rendered and compared too, so their templates are tested.
                    assert alert.get("exp_annotations"), f"{path.name}: {case['alertname']} without annotations"
    assert set(alerts()) - firing == set(), "alerts never tested firing"
    assert set(alerts()) - silent == set(), "alerts never tested not firing"
    assert (firing | silent) <= set(alerts()), "tests for alerts that do not exist"


def test_alerts_are_actionable() -> None:
    for group in source_groups():
        for rule in group["rules"]:
            if "alert" not in rule:
                assert ":" in rule["record"], f"recording rule {rule['record']}: level:metric:operations"
                continue
            assert rule["alert"].startswith("Raven"), rule["alert"]
            assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
            assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]
