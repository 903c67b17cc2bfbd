"""Pool kinds and gzip before the uplink, with a real gateway and real agents (processes, TLS, loopback).

Pools: ``site-a`` (tunnel; edge-a-1, edge-a-2 behind an exporter that never compresses, edge-a-3 behind one that
gzips itself), ``site-b`` (tunnel, but the gateway says its uplink is free: ``compress: false``), ``cloud-1``
(direct: listed in the gateway's configuration, no agent at all).
"""

from __future__ import annotations

import asyncio
import gzip
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
import pytest
import pytest_asyncio

from raven.demo.launch import LocalCluster, PoolSpec
from raven.demo.simexporter import SimExporter, SimNode
from tests.support.cluster import HOSTS, pick_node_port
from tests.support.metrics import metric_values

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.integration]

CLOUD_ADDRESS = "127.0.10.9"


@dataclass
class PoolsBed:
    cluster: LocalCluster
    plain: SimExporter  # never compresses
    gzipping: SimExporter  # compresses when asked
    port: int


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def bed(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[PoolsBed]:
    port = pick_node_port(HOSTS)
    plain_nodes = [SimNode("edge-a-1", HOSTS[0], port), SimNode("edge-a-2", HOSTS[1], port),
                   SimNode("edge-b-1", HOSTS[3], port)]
    gzip_nodes = [SimNode("edge-a-3", HOSTS[2], port)]
    # One rendering for the whole module, so that a body can be compared byte for byte with what arrives.
    plain = SimExporter(plain_nodes, refresh=3600, serve_gzip=False)
    gzipping = SimExporter(gzip_nodes, refresh=3600)
    await plain.start()
    await gzipping.start()
    cluster = LocalCluster(
        tmp_path_factory.mktemp("raven-pools"),
        [PoolSpec("site-a", [*plain_nodes[:2], *gzip_nodes], agents=1), PoolSpec("site-b", plain_nodes[2:], agents=1)],
        allowed_ports=[port],
        gateway_settings={
            "front": {"request_timeout": 10},
            "hosts": {"service_addresses": ["192.0.2.10"]},
            "pools": {"site-b": {"compress": False},
                      "cloud-1": {"reach": "direct", "nodes": [{"name": "cloud-gpu-1", "address": CLOUD_ADDRESS}]}},
        },
    )
    try:
        await cluster.start()
        yield PoolsBed(cluster, plain, gzipping, port)
    finally:
        await cluster.close()
        await plain.close()
        await gzipping.close()


async def get(bed: PoolsBed, node: str, accept: str | None) -> tuple[int, aiohttp.ClientResponse, bytes]:
    """A scrape in proxy mode; ``accept``: the Accept-Encoding sent (None: no such header at all)."""
    headers = {"Accept-Encoding": accept} if accept is not None else {}
    skip = () if accept is not None else ("Accept-Encoding",)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15), auto_decompress=False,
                                     skip_auto_headers=skip) as http:
        async with http.get(f"http://{node}:{bed.port}/metrics", proxy=bed.cluster.front_url,
                            headers=headers) as resp:
            return resp.status, resp, await resp.read()


async def test_gzip_through_the_tunnel_decodes_to_exactly_the_exporters_bytes(bed: PoolsBed) -> None:
    status, resp, body = await get(bed, "edge-a-1", "gzip")
    assert status == 200, body
    assert resp.headers["Content-Encoding"] == "gzip"
    assert "accept-encoding" in resp.headers["Vary"].lower()
    assert "Content-Length" not in resp.headers and resp.headers["Transfer-Encoding"] == "chunked"
    page = bed.plain.body("edge-a-1")
    assert gzip.decompress(body) == page
    assert len(body) <= len(page) // 10, (len(body), len(page))  # what crossed the tunnel: a tenth or less


async def test_without_accept_encoding_the_body_passes_unchanged(bed: PoolsBed) -> None:
    for accept in (None, "identity", "gzip;q=0, br"):
        status, resp, body = await get(bed, "edge-a-2", accept)
        assert status == 200
        assert "Content-Encoding" not in resp.headers, accept
        assert body == bed.plain.body("edge-a-2")
        assert int(resp.headers["Content-Length"]) == len(body)


async def test_an_exporter_that_gzips_is_not_compressed_twice(bed: PoolsBed) -> None:
    status, resp, body = await get(bed, "edge-a-3", "gzip")
    assert status == 200
    assert resp.headers["Content-Encoding"] == "gzip"
    assert body == bed.gzipping.gzip_body("edge-a-3")  # the node's own gzip bytes, as it sent them
    assert gzip.decompress(body) == bed.gzipping.body("edge-a-3")


async def test_a_pool_with_a_free_uplink_is_not_compressed(bed: PoolsBed) -> None:
    status, resp, body = await get(bed, "edge-b-1", "gzip")
    assert status == 200
    assert "Content-Encoding" not in resp.headers
    assert body == bed.plain.body("edge-b-1")


async def test_head_is_not_compressed(bed: PoolsBed) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15)) as http:
        async with http.head(f"http://edge-a-1:{bed.port}/metrics", proxy=bed.cluster.front_url,
                             headers={"Accept-Encoding": "gzip"}) as resp:
            assert resp.status == 200
            assert "Content-Encoding" not in resp.headers
            assert await resp.read() == b""


async def test_a_compressed_response_that_breaks_midway_reaches_the_client_broken(bed: PoolsBed) -> None:
    bed.plain.set_mode("edge-a-2", "break")  # Content-Length, half the body, then a reset
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15), auto_decompress=False) as http:
            async with http.get(f"http://edge-a-2:{bed.port}/metrics", proxy=bed.cluster.front_url,
                                headers={"Accept-Encoding": "gzip"}) as resp:
                if resp.status == 502:  # the reset overtook the half body: nothing was sent yet, a clean 502
                    assert "edge-a-2" in await resp.text()
                    return
                assert resp.status == 200
                assert resp.headers["Content-Encoding"] == "gzip"
                got = b""
                with pytest.raises((aiohttp.ClientPayloadError, aiohttp.ClientConnectionError)):
                    async for chunk in resp.content.iter_any():
                        got += chunk
        # Whatever arrived is not a whole gzip stream.
        with pytest.raises((EOFError, OSError)):
            gzip.decompress(got)
    finally:
        bed.plain.set_mode("edge-a-2", "ok")


async def test_the_agent_counts_both_sizes(bed: PoolsBed) -> None:
    agent = bed.cluster.agents["agent-site-a-1"]
    before = await metric_values(agent.metrics_port, "raven_agent_bytes_total")
    await get(bed, "edge-a-1", "gzip")
    after = await metric_values(agent.metrics_port, "raven_agent_bytes_total")

    def grew(direction: str) -> float:
        key = (("direction", direction),)
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert grew("from_node") == len(bed.plain.body("edge-a-1"))
    assert 0 < grew("to_gateway") <= grew("from_node") / 10


async def test_a_direct_pool_is_refused_with_421_and_needs_no_agent(bed: PoolsBed) -> None:
    status, _, body = await get(bed, "cloud-gpu-1", "gzip")
    assert status == 421, body
    assert b"node 'cloud-gpu-1' of pool 'cloud-1' is reached directly (reach: direct)" in body
    assert b"without the proxy" in body


async def test_sd_lists_every_pool_with_its_reach(bed: PoolsBed) -> None:
    groups = await bed.cluster.sd()
    by_node = {g["labels"]["node"]: g for g in groups}
    assert sorted(by_node) == ["cloud-gpu-1", "edge-a-1", "edge-a-2", "edge-a-3", "edge-b-1"]
    cloud = by_node["cloud-gpu-1"]
    assert cloud["targets"] == [f"{CLOUD_ADDRESS}:{bed.port}"]  # hosts.direct: omit -> its address
    assert cloud["labels"]["__meta_raven_reach"] == "direct"
    assert cloud["labels"]["instance"] == f"cloud-gpu-1:{bed.port}"
    assert cloud["labels"]["pool"] == "cloud-1"
    for name in ("edge-a-1", "edge-b-1"):
        assert by_node[name]["labels"]["__meta_raven_reach"] == "tunnel"
        assert by_node[name]["targets"] == [f"{name}:{bed.port}"]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
        async with http.get(bed.cluster.sd_url, params={"reach": "direct"}) as resp:
            assert [g["labels"]["node"] for g in await resp.json()] == ["cloud-gpu-1"]
        async with http.get(bed.cluster.sd_url, params={"reach": "sideways"}) as resp:
            assert resp.status == 400
            assert "reach must be one of tunnel, direct, layer3" in await resp.text()


async def test_status_shows_each_pools_reach(bed: PoolsBed) -> None:
    base = bed.cluster.sd_url.removesuffix("/sd")
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
        async with http.get(base + "/status") as resp:
            snap = await resp.json()
        async with http.get(base + "/hosts") as resp:
            hosts = await resp.text()
        async with http.get(base + "/status.html") as resp:
            page = await resp.text()
    pools = {p["pool"]: p for p in snap["pools"]}
    assert pools["cloud-1"]["reach"] == "direct" and pools["cloud-1"]["reach_from"] == "config"
    assert pools["cloud-1"]["agents"] == [] and pools["cloud-1"]["nodes"] == 1
    assert pools["site-a"]["reach"] == "tunnel" and pools["site-a"]["reach_from"] == "default"
    assert "none needed: Prometheus scrapes this pool without the proxy" in page
    assert "no agent connected" not in page
    # The hosts file names the tunnel pools' nodes only.
    assert "192.0.2.10\tedge-a-1\n" in hosts and "cloud-gpu-1" not in hosts


async def test_raven_status_prints_the_reach(bed: PoolsBed) -> None:


    base = bed.cluster.sd_url.removesuffix("/sd")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "raven.cli", "status", "--gateway", base, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 30)
    text = out.decode()
    assert proc.returncode == 0, text
    line = next(li for li in text.splitlines() if li.startswith("cloud-1"))
    assert "direct" in line and "no agent needed" in line, text
