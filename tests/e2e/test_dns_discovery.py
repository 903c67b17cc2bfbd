"""Names resolve and targets are discovered: the gateway's hosts file served by a real dnsmasq,
`raven dns check` against it, and a real Prometheus finding and scraping every edge node via HTTP SD."""

from __future__ import annotations

import asyncio
import functools
import json
import shutil
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from raven.aio import stop_process
from raven.demo.launch import LocalCluster, PoolSpec, free_port
from raven.demo.simexporter import SimExporter, SimNode
from tests.support.cluster import pick_node_port
from tests.support.dnsmasq import Dnsmasq
from tests.support.polling import eventually

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.integration]

NODE_HOSTS = ["127.0.60.2", "127.0.60.3", "127.0.60.4"]
SERVICE = "127.0.60.1"  # what every edge name must resolve to


class DnsBed:
    def __init__(self, cluster: LocalCluster, dns: Dnsmasq, hosts_file: Path, port: int) -> None:
        self.cluster = cluster
        self.dns = dns
        self.hosts_file = hosts_file
        self.port = port
        self.ops = f"http://127.0.0.1:{cluster.gateway_metrics_port}"

NOT_YET = (OSError, aiohttp.ClientError, ValueError, KeyError)  # a server still starting: poll on
poll = functools.partial(eventually, timeout=20, interval=0.2, tolerate=NOT_YET)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def dbed(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[DnsBed]:
    workdir = tmp_path_factory.mktemp("raven-dns")
    hosts_dir = workdir / "edge"
    hosts_dir.mkdir()
    hosts_file = hosts_dir / "tunnel-nodes"
    port = pick_node_port(NODE_HOSTS)
    nodes = [SimNode(f"gpu-{i}", host, port) for i, host in enumerate(NODE_HOSTS, 1)]
    exporter = SimExporter(nodes)
    cluster = LocalCluster(
        workdir, [PoolSpec("lab", nodes, agents=1)], allowed_ports=[port],
        gateway_settings={"hosts": {"file": str(hosts_file), "service_addresses": [SERVICE], "debounce": 0.2}},
    )
    dns = Dnsmasq(hosts_dir, watch_dir=True)
    try:
        await exporter.start()
        await cluster.start()
        await dns.start()
        yield DnsBed(cluster, dns, hosts_file, port)
    finally:
        await dns.close()
        await cluster.close()
        await exporter.close()





def raven(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "raven.cli", *args], capture_output=True, text=True, timeout=60)


async def test_hosts_file_follows_registrations(dbed: DnsBed) -> None:
    async def written() -> bool:
        text = dbed.hosts_file.read_text()
        return all(f"{SERVICE}\tgpu-{i}" in text for i in (1, 2, 3))

    await poll(written)
    async with aiohttp.ClientSession() as http, http.get(dbed.ops + "/hosts") as resp:
        assert await resp.text() == dbed.hosts_file.read_text()
    rendered = await asyncio.to_thread(raven, "hosts", "render", "--gateway", dbed.ops)
    assert rendered.returncode == 0, rendered.stderr
    assert rendered.stdout.replace("raven hosts render", "raven gateway") == dbed.hosts_file.read_text()


async def test_dns_check_against_a_real_dns_server(dbed: DnsBed) -> None:
    out = await asyncio.to_thread(raven, "dns", "check", "--server", dbed.dns.server, "--gateway", dbed.ops)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "3 of 3 names resolve to the Raven service" in out.stdout
    # A name nobody published, and a wrong expectation, both fail with a clear line and exit 1.
    out = await asyncio.to_thread(raven, "dns", "check", "--server", dbed.dns.server, "--node", "gpu-9",
                                  "--address", SERVICE)
    assert out.returncode == 1
    assert "gpu-9" in out.stdout and "WRONG" in out.stdout
    out = await asyncio.to_thread(raven, "dns", "check", "--server", dbed.dns.server, "--node", "gpu-1",
                                  "--address", "127.0.60.99")
    assert out.returncode == 1 and "127.0.60.1" in out.stdout


# ---------------------------------------------------------------- real Prometheus


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def prometheus(dbed: DnsBed) -> AsyncIterator[str]:
    exe = shutil.which("prometheus")
    if exe is None:
        raise RuntimeError("prometheus is not installed (Debian package prometheus; scripts/test.sh installs it)")
    work = dbed.cluster.workdir / "prometheus"
    work.mkdir()
    config = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{
            "job_name": "edge-dcgm",
            "proxy_url": dbed.cluster.front_url,
            "http_sd_configs": [{"url": dbed.ops + "/sd", "refresh_interval": "1s"}],
        }],
    }
    (work / "prometheus.yml").write_text(json.dumps(config))
    port = free_port()
    with (work / "prometheus.log").open("wb") as log:  # the child keeps its own descriptor
        proc = await asyncio.create_subprocess_exec(
            exe, f"--config.file={work / 'prometheus.yml'}", f"--storage.tsdb.path={work / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn",
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL, stderr=log,
        )
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await stop_process(proc, signal.SIGTERM, 10)


async def prom_query(url: str, query: str) -> list[dict[str, Any]]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
        async with http.get(url + "/api/v1/query", params={"query": query}) as resp:
            data = await resp.json()
    result: list[dict[str, Any]] = data["data"]["result"]
    return result


async def test_prometheus_discovers_and_scrapes_every_edge_node(dbed: DnsBed, prometheus: str) -> None:
    async def all_up() -> bool:
        up = await prom_query(prometheus, 'up{job="edge-dcgm"}')
        return len(up) == 3 and all(r["value"][1] == "1" for r in up)

    await poll(all_up, timeout=40)
    series = await prom_query(prometheus, 'DCGM_FI_DEV_GPU_UTIL{job="edge-dcgm", gpu="0"}')
    assert sorted(r["metric"]["node"] for r in series) == ["gpu-1", "gpu-2", "gpu-3"]
    for r in series:
        assert r["metric"]["pool"] == "lab"
        assert r["metric"]["Hostname"] == r["metric"]["node"]  # the exporter of that very node answered
        assert r["metric"]["instance"] == f"{r['metric']['node']}:{dbed.port}"


async def test_a_node_that_leaves_leaves_dns_and_discovery(dbed: DnsBed, prometheus: str) -> None:
    cluster = dbed.cluster
    pool = cluster.pools[0]
    pool.nodes = [n for n in pool.nodes if n.name != "gpu-3"]
    await cluster.stop(cluster.agents["agent-lab-1"])
    await cluster.start_agent(pool, "agent-lab-1")  # re-registers without gpu-3

    async def gone() -> bool:
        return "gpu-3" not in dbed.hosts_file.read_text() and all(
            g["labels"]["node"] != "gpu-3" for g in await cluster.sd()
        )

    await poll(gone)
    out = await asyncio.to_thread(raven, "dns", "check", "--server", dbed.dns.server, "--node", "gpu-3",
                                  "--address", SERVICE)
    assert out.returncode == 1  # dnsmasq re-read the file by itself: gpu-3 no longer resolves

    async def prometheus_dropped_it() -> bool:
        async with aiohttp.ClientSession() as http, http.get(prometheus + "/api/v1/targets") as resp:
            targets = (await resp.json())["data"]["activeTargets"]
        return sorted(t["labels"]["node"] for t in targets) == ["gpu-1", "gpu-2"]

    await poll(prometheus_dropped_it, timeout=30)
