"""Backfill end to end on loopback (issue 32): real gateway and agent processes, a simulated dcgm-exporter, a
remote-write receiver. An HA pair of Prometheus stand-ins (two client addresses, each at its own phase per node)
scrapes 8 nodes through the front end at 1 s; the gateway is killed (the pool's two agents hold no session: an
outage as they see it), comes back, and what the agents scraped meanwhile must reach the receiver: every
interval of the outage but at most the first, for every series of every node, exactly once (each node kept by one
agent of the two: two would write it twice, at their own phases), with the values the exporter served, the
target's labels, and no ``up``."""

from __future__ import annotations

import asyncio
import itertools
import signal
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest
import pytest_asyncio

from gateway import exposition
from raven.demo.dcgm_page import NodeModel
from raven.demo.launch import LocalCluster, PoolSpec
from raven.demo.simexporter import SimExporter, SimNode
from tests.support.cluster import HOSTS, pick_node_port
from tests.support.metrics import metric_values
from tests.support.polling import eventually
from tests.support.rwreceiver import Receiver

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.integration]

INTERVAL = 1.0
REFRESH = 1.0
NODES = 8
PAIR = ("127.0.0.1", "127.0.0.3")  # the HA pair's addresses: the gateway tells the agents two clients
PROM_ACCEPT = ("application/openmetrics-text;version=1.0.0;q=0.5,text/plain;version=0.0.4;q=0.4,*/*;q=0.1")


class Bed:
    def __init__(self, cluster: LocalCluster, exporter: SimExporter, receiver: Receiver, port: int) -> None:
        self.cluster = cluster
        self.exporter = exporter
        self.receiver = receiver
        self.port = port
        self.nodes = [n.name for n in exporter.nodes]
        self.live: dict[str, dict[float, int]] = {n: {} for n in self.nodes}  # node -> scrape start -> status

    async def prometheus(self, stop: asyncio.Event, source: str, phase: float) -> None:
        """One Prometheus of an HA pair, from its own address: every node through the front end at INTERVAL, each
        at its own offset in the interval (Prometheus spreads its targets), the pair at ``phase`` apart."""
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.9),
                                         connector=aiohttp.TCPConnector(local_addr=(source, 0))) as http:

            async def scrape(node: str, offset: float) -> None:
                await asyncio.sleep(offset)
                while not stop.is_set():
                    at = time.time()
                    try:
                        async with http.get(f"{self.cluster.front_url}/metrics", headers={
                                "Host": f"{node}:{self.port}", "Accept": PROM_ACCEPT}) as r:
                            await r.read()
                            self.live[node][at] = r.status
                    except (aiohttp.ClientError, TimeoutError, OSError):
                        self.live[node][at] = 0
                    await asyncio.sleep(max(0.0, at + INTERVAL - time.time()))

            await asyncio.gather(*(scrape(node, (phase + i / len(self.nodes)) * INTERVAL % INTERVAL)
                                   for i, node in enumerate(self.nodes)))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def bed(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Bed]:
    port = pick_node_port(HOSTS)
    nodes = [SimNode(f"bf-{i + 1}", HOSTS[i], port) for i in range(NODES)]
    exporter = SimExporter(nodes, refresh=REFRESH, serve_gzip=False)
    await exporter.start()
    work = tmp_path_factory.mktemp("backfill")
    token = work / "rw-token"
    token.write_text("rw-secret\n")
    receiver = Receiver(token="rw-secret")
    await receiver.start()
    cluster = LocalCluster(
        work, [PoolSpec("pool-bf", nodes, agents=2)], allowed_ports=[port, 9100],
        gateway_settings={"backfill": {"receivers": [{"url": receiver.url, "token_file": str(token)}],
                                       "jobs": {port: "edge-dcgm"}, "poll_interval": 1}},
        agent_settings={"backfill": {"directory": str(work / "backlog")}},
    )
    try:
        await cluster.start()
        yield Bed(cluster, exporter, receiver, port)
    finally:
        await cluster.close()
        await receiver.close()
        await exporter.close()


def _pages(node: SimNode, ticks: int) -> dict[frozenset[tuple[str, tuple[tuple[str, str], ...], float]], int]:
    """Every page the exporter can have served in the test, as its set of samples -> its tick."""
    model = NodeModel(node.name, node.gpus, 4, target_bytes=node.size, interval=REFRESH)
    return {frozenset((n, tuple(sorted(lb)), v) for n, lb, v in exposition.parse(model.render(t))): t
            for t in range(ticks)}


async def test_an_outage_leaves_no_hole(bed: Bed) -> None:
    stop = asyncio.Event()
    prom = asyncio.gather(bed.prometheus(stop, PAIR[0], 0.0), bed.prometheus(stop, PAIR[1], 0.45))
    try:
        # The agents learn the cadence from the scrapes they relay: the gateway sends a node's scrapes, both
        # clients', through one of them (gateway/rendezvous.py).
        await asyncio.sleep(12 * INTERVAL)
        gateway = bed.cluster.gateway
        assert gateway is not None
        cut = time.time()
        await bed.cluster.stop(gateway, signal.SIGKILL)
        await asyncio.sleep(10 * INTERVAL)
        back = time.time()
        await bed.cluster.start_gateway()
        # Everything kept is written and acknowledged: the agents' backlogs empty.
        async def drained() -> bool:
            kept = acked = 0.0
            for agent in bed.cluster.agents.values():
                kept += sum((await metric_values(agent.metrics_port, "raven_agent_backfill_kept_total")).values())
                acked += sum((await metric_values(agent.metrics_port,
                                                  "raven_agent_backfill_acknowledged_total")).values())
            return kept > 0 and acked >= kept

        await eventually(drained, 30, "the agent's backlog written and acknowledged")
        await asyncio.sleep(2 * INTERVAL)  # and a live scrape of every node after it
    finally:
        stop.set()
        await prom
    by_node: dict[str, dict[int, set[tuple[str, tuple[tuple[str, str], ...], float]]]] = {}
    for labels, samples in bed.receiver.samples.items():
        d = dict(labels)
        assert d["job"] == "edge-dcgm" and d["pool"] == "pool-bf" and d["instance"] == f"{d['node']}:{bed.port}"
        assert d["__name__"] != "up"
        own = tuple(sorted((k, v) for k, v in labels if k not in ("__name__", "job", "instance", "node", "pool")))
        for ts, value in samples.items():
            by_node.setdefault(d["node"], {}).setdefault(ts, set()).add((d["__name__"], own, value))
        # Every interval of the outage but at most the first (the agent notices the loss within one) has this
        # series' sample, and one only: a node kept by both agents has two an interval, at their own phases.
        windows = [sum(1 for ts in samples if cut + k * INTERVAL <= ts / 1000 < cut + (k + 1) * INTERVAL)
                   for k in range(1, int((back - cut) / INTERVAL) - 1)]
        assert windows == [1] * len(windows), (d["node"], d["__name__"], windows)
    assert sorted(by_node) == bed.nodes
    for node in bed.exporter.nodes:
        kept = by_node[node.name]
        stamps = sorted(kept)
        # No more than one a cadence: one agent of the two kept the node, at the cadence it learned.
        gaps = [b - a for a, b in itertools.pairwise(stamps)]
        assert min(gaps) >= 0.8 * INTERVAL * 1000, gaps
        # Each kept scrape is a page the exporter served, sample for sample.
        pages = _pages(node, int(time.time() - cut) + 60)
        for ts, got in kept.items():
            assert frozenset(got) in pages, f"{node.name} at {ts}: not a page the exporter served"
        # The live scrapes failed while it was down (up stays 0 there: Prometheus records that itself), and
        # succeed before and after: the node's requests go through one agent, as Prometheus sees no difference.
        live = bed.live[node.name]
        assert any(status != 200 for at, status in live.items() if cut < at < back)
        assert all(status == 200 for at, status in live.items() if at < cut - INTERVAL), node.name
        assert any(status == 200 for at, status in live.items() if at > back), node.name
