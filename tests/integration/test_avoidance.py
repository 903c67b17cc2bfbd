"""A node that its rendezvous agent cannot reach is served by the pool's other agent, without a failed first try
at every scrape (gateway/avoidance.py), while the agent's other nodes stay with it (real processes, TLS)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
import yaml

from gateway.rendezvous import weight
from raven.demo.launch import LocalCluster, PoolSpec
from raven.demo.simexporter import SimExporter, SimNode
from tests.support.cluster import pick_node_port
from tests.support.metrics import metric_values

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.integration]

POOL = "pool-v"
AGENTS = [f"agent-{POOL}-1", f"agent-{POOL}-2"]
HOSTS = ["127.0.34.2", "127.0.34.3"]
NOWHERE = "127.0.34.9"  # nothing listens here: the first agent's way to the broken node


def owned_by(agent: str, prefix: str) -> str:
    """A node name whose rendezvous agent is ``agent``."""
    names = (f"{prefix}-{i}" for i in range(1000))
    return next(name for name in names if max(AGENTS, key=lambda a: weight(a, name)) == agent)


BROKEN = owned_by(AGENTS[0], "av-broken")  # the first agent's node, which only the second can reach
FINE = owned_by(AGENTS[0], "av-fine")  # the first agent's node, which it reaches


class OneBrokenPath(LocalCluster):
    def agent_config(self, pool: PoolSpec, name: str, metrics_port: int) -> Path:
        path = super().agent_config(pool, name, metrics_port)
        if name == AGENTS[0]:
            tree: dict[str, Any] = yaml.safe_load(path.read_text())
            for node in tree["nodes"]:
                if node["name"] == BROKEN:
                    node["address"] = NOWHERE
            path.write_text(yaml.safe_dump(tree, sort_keys=False))
        return path


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[tuple[LocalCluster, int]]:
    port = pick_node_port([*HOSTS, NOWHERE])
    nodes = [SimNode(BROKEN, HOSTS[0], port), SimNode(FINE, HOSTS[1], port)]
    exporter = SimExporter(nodes)
    c = OneBrokenPath(tmp_path_factory.mktemp("raven-avoid"), [PoolSpec(POOL, nodes, agents=2)], allowed_ports=[port])
    try:
        await exporter.start()
        await c.start()
        yield c, port
    finally:
        await c.close()
        await exporter.close()


async def scrape(http: aiohttp.ClientSession, c: LocalCluster, node: str, port: int) -> tuple[int, str]:
    async with http.get(f"http://{node}:{port}/metrics", proxy=c.front_url) as resp:
        body = await resp.read()
        ok = resp.status == 200 and f'Hostname="{node}"'.encode() in body
        return (200 if ok else resp.status), resp.headers.get("X-Raven-Agent", "")


async def retries(c: LocalCluster) -> float:
    return sum((await metric_values(c.gateway_metrics_port, "raven_gateway_retries_total")).values())


async def test_the_broken_path_costs_one_retry_not_one_per_scrape(cluster: tuple[LocalCluster, int]) -> None:
    c, port = cluster
    async with aiohttp.ClientSession() as http:
        before = await retries(c)
        got = [await scrape(http, c, BROKEN, port) for _ in range(8)]
        assert got == [(200, AGENTS[1])] * 8  # every scrape answered, by the agent that reaches the node
        # Without the avoidance every one of the 8 went first to the node's own agent and failed there: 8.
        assert await retries(c) - before == 1
        # The first agent's other node stays with it.
        assert [await scrape(http, c, FINE, port) for _ in range(3)] == [(200, AGENTS[0])] * 3
    gateway = c.gateway
    assert gateway is not None
    log = gateway.log.read_text(errors="replace")
    assert f"node {BROKEN} (pool '{POOL}') failed through agent {AGENTS[0]}" in log

