"""``raven check``'s gateway side against the real processes of the netns testbed (tests/support/testbed.py): the
gateway, four agents in two edge sites, dnsmasq serving the gateway's hosts file, Debian's Prometheus scraping the
edge nodes through the tunnel. The cluster side is the fake API server (listening on this host's end of the
observer link), seeded with ``raven install``'s objects for the testbed's pools, Nodes and hosts file; the check
runs inside the cloud namespace, where the gateway's ops port, the DNS server and Prometheus are.

Every check passes; then one site's uplink is cut: that pool's agents lose their sessions, Prometheus records
``up`` 0 for its nodes, and the check names both, with their fixes.

    flock /tmp/raven-netns.lock .venv/bin/python -m pytest -q tests/e2e/test_check_testbed.py
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import yaml

from tests.integration.test_check import seed
from tests.support.fakekube import FakeKube
from tests.support.testbed import CLOUD_IP, CLOUD_NODES, CLOUD_POOL, Testbed

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.integration]

HOST_ON_OBSERVER_LINK = "10.199.0.1"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def bed(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[tuple[Testbed, Path]]:
    work = tmp_path_factory.mktemp("check-testbed")
    tb = Testbed(work / "bed")
    fake = FakeKube(host=HOST_ON_OBSERVER_LINK)
    try:
        await tb.start()
        await tb.wait_all_up(90)
        pools = [{"name": s.pool} for s in tb.sites] + [{"name": CLOUD_POOL, "reach": "direct"}]
        (work / "answers.yaml").write_text(yaml.safe_dump({"service_address": CLOUD_IP, "certificates": "raven",
                                                           "monitoring": "none", "pools": pools}))
        proc = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "raven.cli", "install", "-f",
                                                        "answers.yaml", "--with-secrets"],
                                       cwd=work, capture_output=True, text=True, timeout=180, check=False)
        assert proc.returncode == 0, proc.stderr
        await fake.start()
        seed(fake, [d for d in yaml.safe_load_all(proc.stdout) if d],
             edge={n: s.pool for s in tb.sites for n in s.nodes}, direct=dict.fromkeys(CLOUD_NODES, CLOUD_POOL),
             hosts=(tb.hosts_dir / "tunnel-nodes").read_text())
        fake.write_kubeconfig(work / "kubeconfig")
        yield tb, work
    finally:
        await fake.close()
        await tb.close()


async def raven_check(tb: Testbed, work: Path) -> tuple[int, dict[str, Any]]:
    args = ["ip", "netns", "exec", "rv-cloud", sys.executable, "-m", "raven.cli", "check", "-o", "json",
            "--kubeconfig", str(work / "kubeconfig"), "--gateway", "http://127.0.0.1:10265",
            "--token-file", str(tb.token_file), "--dns-server", "127.0.0.1", "--prometheus", "http://127.0.0.1:9090",
            "--timeout", "5"]
    proc = await asyncio.create_subprocess_exec(*args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 90)
    assert b"Traceback" not in err, err.decode()
    return int(proc.returncode or 0), json.loads(out)


def failures(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["check"]: c for c in doc["checks"] if not c["ok"]}


async def test_raven_check_against_the_real_testbed(bed: tuple[Testbed, Path]) -> None:
    tb, work = bed
    code, doc = await raven_check(tb, work)
    rows = {c["check"]: c["detail"] for c in doc["checks"]}
    assert failures(doc) == {} and code == 0, json.dumps(doc, indent=1)
    assert rows["agents site-a"] == "2 ready agent(s), sessions to 1 of 1 replicas"
    assert "gpu-a-1, gpu-a-2, gpu-b-1 resolve to 10.200.0.1 via 127.0.0.1" in rows["dns-sample"]
    assert "edge-dcgm 4 targets" in rows["prometheus"] and "up is 1 for gpu-a-1" in rows["prometheus"]
    assert rows["clock-skew"].startswith("6 clocks within 5s of the API server's"), rows["clock-skew"]
    assert "cloud-1 " in rows["descriptors"] and "needs 2060" in rows["descriptors"], rows["descriptors"]

    # Site b's uplink is cut: its agents' sessions end, Prometheus's scrapes of its nodes fail.
    site = tb.sites[1]
    await tb.shape_uplink(site, 0, 100, 1000)
    try:
        for _ in range(60):
            code, doc = await raven_check(tb, work)
            bad = failures(doc)
            if "agents site-b" in bad and "up is 0 for gpu-b-" in bad.get("prometheus", {}).get("detail", ""):
                break
            await asyncio.sleep(1)
        assert code == 1 and set(bad) == {"agents site-b", "prometheus"}, json.dumps(bad, indent=1)
        assert "no session to replica(s) cloud-1" in bad["agents site-b"]["detail"]
        assert "raven status --gateway" in bad["prometheus"]["fix"] and "--node gpu-b-" in bad["prometheus"]["fix"]
    finally:
        await tb.unshape_uplink(site)
