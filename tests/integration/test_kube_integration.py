"""Kubernetes mode end to end against the fake API server: real gateway and agent processes."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from raven.demo.launch import LocalCluster, PoolSpec
from raven.demo.simexporter import SimExporter, SimNode
from tests.support.cluster import pick_node_port
from tests.support.fakekube import FakeKube
from tests.support.polling import eventually

poll = functools.partial(eventually, timeout=20, interval=0.2)

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.integration]

LABEL = "apps.openyurt.io/nodepool"
SERVICE = "127.0.70.1"


class KBed:
    def __init__(self, cluster: LocalCluster, kube: FakeKube, port: int) -> None:
        self.cluster = cluster
        self.kube = kube
        self.port = port

    async def sd_nodes(self) -> list[str]:
        return sorted(g["labels"]["node"] for g in await self.cluster.sd())

    def hosts_configmap(self) -> str:
        cm: Any = self.kube.configmaps.get(("kube-system", "edge-tunnel-nodes"))
        return "" if cm is None else str(cm["data"]["tunnel-nodes"])


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def kbed(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[KBed]:
    hosts = ["127.0.70.2", "127.0.70.3", "127.0.70.4", "127.0.70.5"]
    port = pick_node_port(hosts)
    exporter = SimExporter([SimNode("edge-k-1", hosts[0], port), SimNode("edge-k-2", hosts[1], port),
                            SimNode("other-1", hosts[2], port), SimNode("edge-k-3", hosts[3], port)])
    kube = FakeKube(bookmark_interval=0.5)
    workdir = tmp_path_factory.mktemp("raven-kube")
    try:
        await kube.start()
        kubeconfig = kube.write_kubeconfig(workdir / "kubeconfig")
        kube.add_node("edge-k-1", {LABEL: "site-k"}, [hosts[0]])
        kube.add_node("edge-k-2", {LABEL: "site-k"}, [hosts[1]])
        kube.add_node("other-1", {LABEL: "other"}, [hosts[2]])
        kube.add_node("cloud-1", {}, ["127.0.70.9"])  # not an edge node: no pool label
        k8s = {"enabled": True, "kubeconfig": str(kubeconfig)}
        cluster = LocalCluster(
            workdir, [PoolSpec("site-k", [], agents=1)], allowed_ports=[port],
            gateway_settings={"kubernetes": k8s, "hosts": {
                "service_addresses": [SERVICE], "debounce": 0.2, "configmap": {},
                "lease": {"duration": 3}}},
            agent_settings={"kubernetes": k8s},
        )
        await exporter.start()
        await cluster.start()
        yield KBed(cluster, kube, port)
    finally:
        await cluster.close()
        await exporter.close()
        await kube.close()





async def test_agent_serves_its_pools_nodes_from_node_objects(kbed: KBed) -> None:
    async def registered() -> bool:
        return await kbed.sd_nodes() == ["edge-k-1", "edge-k-2"]

    await poll(registered)
    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://edge-k-2:{kbed.port}/metrics", proxy=kbed.cluster.front_url) as resp:
            assert resp.status == 200
            assert b'Hostname="edge-k-2"' in await resp.read()


async def test_gateway_publishes_every_edge_node_to_the_configmap_under_a_lease(kbed: KBed) -> None:
    async def published() -> bool:
        text = kbed.hosts_configmap()
        return all(f"{SERVICE}\t{n}" in text for n in ("edge-k-1", "edge-k-2", "other-1"))

    await poll(published)
    assert "cloud-1" not in kbed.hosts_configmap()  # only Nodes with the pool label are edge nodes
    lease: Any = kbed.kube.leases[("kube-system", "raven-hosts-publisher")]
    assert lease["spec"]["holderIdentity"] == "gw-1"
    # Nodes are watched, not polled: one LIST by each process, then WATCH requests only.
    lists = kbed.kube.node_requests(watch=False)
    assert len(lists) == 2, lists
    assert len(kbed.kube.node_requests(watch=True)) >= 2


async def test_new_and_deleted_nodes_follow_through(kbed: KBed) -> None:
    kbed.kube.add_node("edge-k-3", {LABEL: "site-k"}, ["127.0.70.5"])
    kbed.kube.delete_node("edge-k-2")

    async def followed() -> bool:
        text = kbed.hosts_configmap()
        return (await kbed.sd_nodes() == ["edge-k-1", "edge-k-3"]
                and "edge-k-3" in text and "edge-k-2" not in text)

    await poll(followed)
    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://edge-k-3:{kbed.port}/metrics", proxy=kbed.cluster.front_url) as resp:
            assert resp.status == 200


async def test_a_cloud_pools_nodes_are_scraped_directly_by_their_labels(kbed: KBed) -> None:
    """OpenYurt labels a Cloud NodePool's nodes openyurt.io/is-edge-worker=false: the gateway reads that (no
    NodePool read, no configuration) as reach: direct; raven.io/reach overrides it."""
    kbed.kube.add_node("yurt-cloud-1", {LABEL: "yurt-cloud", "openyurt.io/is-edge-worker": "false"},
                       [("ExternalIP", "203.0.113.9"), "127.0.70.8"])
    try:
        async def listed_directly() -> bool:
            groups = {g["labels"]["node"]: g for g in await kbed.cluster.sd()}
            cloud = groups.get("yurt-cloud-1")
            return (cloud is not None and cloud["labels"]["__meta_raven_reach"] == "direct"
                    and cloud["targets"] == [f"127.0.70.8:{kbed.port}"] and cloud["labels"]["pool"] == "yurt-cloud")

        await poll(listed_directly)
        assert "yurt-cloud-1" not in kbed.hosts_configmap()  # left to the cluster's own resolution
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://yurt-cloud-1:{kbed.port}/metrics", proxy=kbed.cluster.front_url) as resp:
                assert resp.status == 421
                assert "(reach: direct): scrape it without the proxy" in await resp.text()
        kbed.kube.update_node("yurt-cloud-1", labels={LABEL: "yurt-cloud", "openyurt.io/is-edge-worker": "false",
                                                      "raven.io/reach": "tunnel"})

        async def through_raven() -> bool:
            return (f"{SERVICE}\tyurt-cloud-1" in kbed.hosts_configmap()
                    and "yurt-cloud-1" not in await kbed.sd_nodes())  # a tunnel node is listed once an agent serves it

        await poll(through_raven)
    finally:
        kbed.kube.delete_node("yurt-cloud-1")
