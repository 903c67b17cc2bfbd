"""The agent's /metrics does not grow with its fleet: 1,000 nodes' traffic through a real forwarder.

A gateway-side session (in memory) opens streams to 1,000 distinct nodes of one agent's inventory; the agent's
forwarder serves them against real loopback sockets: most nodes answer 200, every tenth is on a port where
nothing listens (connect-failed), and a few names are not in the inventory (refused). The page that the
agent's ops port would serve (its registry, rendered) must stay under 64 KiB and name no node, while the
per-pool counters still add up to every request.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from agent.checks import Policy
from agent.forwarder import Forwarder
from raven.ops.metrics import AgentMetrics
from raven.protocol import wire
from raven.transport.tunnel import StreamReset, Tunnel
from tests.support.memsession import pair

pytestmark = [pytest.mark.integration]

NODES = 1000
PAGE_LIMIT = 64 * 1024
ANSWER = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 10\r\n\r\nnode_up 1\n"


async def _exporter(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while await reader.readuntil(b"\r\n\r\n"):
            writer.write(ANSWER)
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


def dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def scrape(gw: Tunnel, node: str, port: int) -> int:
    """One GET through the tunnel: the status, or 0 when the agent reset the stream."""
    stream = gw.open_stream(wire.Open(0, wire.StreamKind.HTTP, node, port, "GET", "/metrics",
                                      (("host", f"{node}:{port}"),), True))
    try:
        head = await asyncio.wait_for(stream.head(), 10)
        while await asyncio.wait_for(stream.read(), 10):
            pass
        return head.status
    except StreamReset:
        return 0


@pytest.fixture
async def exporter() -> AsyncIterator[int]:
    server = await asyncio.start_server(_exporter, "127.0.0.1", 0)
    try:
        yield int(server.sockets[0].getsockname()[1])
    finally:
        server.close()
        await server.wait_closed()


async def test_agent_metrics_page_stays_small_with_1000_nodes(exporter: int) -> None:
    metrics = AgentMetrics()
    dead = dead_port()
    inventory = {f"edge-gpu-{i}": "127.0.0.1" for i in range(NODES)}
    forwarder = Forwarder(
        nodes=lambda: inventory,
        policy=Policy(frozenset({exporter, dead}), frozenset({"GET", "HEAD"}), False, 10.0),
        metrics=metrics, connect_timeout=5.0, connections_per_node=4, draining=lambda: False, pool="edge",
    )
    gw, ag, tasks = await pair(forwarder.on_open)
    statuses: list[int] = []
    try:
        names = [*inventory, "not-mine-1", "not-mine-2"]
        for first in range(0, len(names), 40):  # within the session's 64 streams at once
            batch = names[first:first + 40]
            statuses += await asyncio.gather(*(
                scrape(gw, name, dead if i % 10 == 0 else exporter)
                for i, name in enumerate(batch, start=first)))
    finally:
        await forwarder.close()
        for session in (gw, ag):
            await session.close("test over")
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    assert statuses.count(200) == 900 and statuses.count(0) == 102, statuses
    page = generate_latest(metrics.registry)
    assert len(page) <= PAGE_LIMIT, f"agent /metrics is {len(page)} bytes with {NODES} nodes"
    assert b"edge-gpu-" not in page, "a per-node series is back"
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(page.decode()) for s in family.samples}
    assert samples[("raven_agent_requests_total", (("code", "200"), ("kind", "http")))] == 900
    assert samples[("raven_agent_requests_total", (("code", "connect-failed"), ("kind", "http")))] == 100
    assert samples[("raven_agent_refused_streams_total", (("reason", "node"),))] == 2
    assert samples[("raven_agent_upstream_duration_seconds_count", ())] == 1000
    assert samples[("raven_agent_upstream_connections_limit", ())] == 4096
    assert ("raven_gc_pause_max_seconds", (("generation", "2"),)) in samples
