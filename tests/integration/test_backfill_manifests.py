"""What backfill needs of Prometheus is shipped (issue 32 item 5): the Operator patch applied to a Prometheus
validates against the Operator's schema; promtool accepts the scrape configuration with its out-of-order window;
the gateway's shipped configuration loads and names a receiver whose jobs are the scrape configuration's."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from raven.config import GatewayConfig
from tests.support import schemas
from tests.support.paths import ROOT

pytestmark = pytest.mark.integration


def test_the_operator_patch_enables_the_receiver_and_the_window() -> None:
    patch = yaml.safe_load((ROOT / "deploy/monitoring/prometheus-backfill-patch.yaml").read_text())
    assert patch["spec"]["enableRemoteWriteReceiver"] is True
    prometheus = {"apiVersion": "monitoring.coreos.com/v1", "kind": "Prometheus",
                  "metadata": {"name": "k", "namespace": "monitoring"},
                  "spec": {"replicas": 2, "serviceMonitorSelector": {}, **patch["spec"]}}
    assert schemas.custom_errors([prometheus]) == [[]]
    assert patch["spec"]["tsdb"]["outOfOrderTimeWindow"] == "2h"  # the gateway's backfill.max_age


def test_the_scrape_configuration_has_the_window_and_promtool_takes_it(tmp_path: Path) -> None:
    tree = yaml.safe_load((ROOT / "deploy/prometheus/scrape-config.yaml").read_text())
    assert tree["storage"]["tsdb"]["out_of_order_time_window"] == "2h"  # the gateway's backfill.max_age
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed")
    token = tmp_path / "token"
    token.write_text("t" * 32 + "\n")
    text = (ROOT / "deploy/prometheus/scrape-config.yaml").read_text().replace(
        "/etc/prometheus/secrets/raven-front-token/token", str(token))
    (tmp_path / "p.yaml").write_text(text)
    proc = subprocess.run([promtool, "check", "config", str(tmp_path / "p.yaml")], capture_output=True, text=True,
                          check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_gateway_configuration_names_a_receiver_and_the_scrape_jobs() -> None:
    tree = yaml.safe_load((ROOT / "deploy/base/config/gateway.yaml").read_text())
    cfg = GatewayConfig.model_fields["backfill"].annotation.model_validate(tree["backfill"])  # type: ignore[union-attr]
    assert cfg.enabled and cfg.receivers and cfg.receivers[0].url.endswith("/api/v1/write")
    jobs = {j["job_name"] for j in yaml.safe_load((ROOT / "deploy/prometheus/scrape-config.yaml").read_text())
            ["scrape_configs"]}
    assert cfg.jobs[9400] in jobs and cfg.max_age == 7200
