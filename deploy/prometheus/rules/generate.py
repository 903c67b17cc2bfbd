"""Write raven.prometheusrule.yaml (a PrometheusRule for the Prometheus Operator) from raven.rules.yaml.

    python deploy/prometheus/rules/generate.py           # rewrite raven.prometheusrule.yaml
    python deploy/prometheus/rules/generate.py --check   # exit 1 if stale (tests/integration/test_rules.py checks too)

raven.rules.yaml is the source: edit it, run its unit tests (promtool test rules tests/*.yaml), regenerate.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "raven.rules.yaml"
TARGET = HERE / "raven.prometheusrule.yaml"

HEADER = """\
# GENERATED from raven.rules.yaml by generate.py: do not edit (python deploy/prometheus/rules/generate.py).
#
# Raven's recording and alerting rules as a PrometheusRule for the Prometheus Operator (kube-prometheus-stack).
# kube-prometheus-stack's Prometheus selects PrometheusRules labelled release: <its Helm release name> unless the
# chart sets prometheus.prometheusSpec.ruleSelectorNilUsesHelmValues: false; change the label to your release.
#
#   kubectl apply -f deploy/prometheus/rules/raven.prometheusrule.yaml
"""


def build(source: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {
            "name": "raven",
            "namespace": "monitoring",
            "labels": {"release": "kube-prometheus-stack", "app.kubernetes.io/name": "raven",
                       "app.kubernetes.io/component": "rules"},
        },
        "spec": {"groups": source["groups"]},
    }


def render() -> str:
    source = yaml.safe_load(SOURCE.read_text())
    body = yaml.safe_dump(build(source), sort_keys=False, width=120, allow_unicode=True)
    return HEADER + body


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if raven.prometheusrule.yaml is stale")
    args = parser.parse_args()
    text = render()
    if args.check:
        if not TARGET.exists() or TARGET.read_text() != text:
            print(f"{TARGET.name} is stale: run python deploy/prometheus/rules/generate.py", file=sys.stderr)
            return 1
        return 0
    TARGET.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
