"""The request's terms reach the agent under every protocol version (docs/protocol.md, OPEN).

The agent's real forwarder serves a real TCP node through a pair of sessions whose version came out of a real
HELLO/WELCOME exchange (joined in memory): version 3 (the terms as OPEN's fields), 2 and 1 (as x-raven-*
headers), as an agent of this release meets a gateway of this release, of 0.1.0, or a version-1 peer. In each, a
scrape passes, the node sees none of Raven's own headers, and the deadline the gateway states is the one the
agent's fair queue holds a waiting request to (the agent's own is far longer). Real processes of both releases:
tests/integration/test_skew.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest

from agent.checks import Policy
from agent.forwarder import Forwarder
from raven.ops.metrics import AgentMetrics
from raven.protocol import Open, OpenFields, handshake, wire
from raven.transport.tunnel import OpenHandler, StreamReset, Tunnel
from tests.support.cluster import HOSTS, pick_node_port
from tests.support.memsession import QueueSink, drain
from tests.support.polling import eventually

pytestmark = [pytest.mark.asyncio, pytest.mark.integration]

NODE = "edge-v-1"
AGENT_TIMEOUT = 60.0  # the agent's own deadline: a test that waited for it would time out first


@dataclass
class HoldingNode:
    """A node that records each request head and answers only once ``answer`` is set."""

    heads: list[bytes] = field(default_factory=list)
    answer: asyncio.Event = field(default_factory=asyncio.Event)
    server: asyncio.Server | None = None
    writers: set[asyncio.StreamWriter] = field(default_factory=set)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writers.add(writer)
        try:
            self.heads.append(await reader.readuntil(b"\r\n\r\n"))
            await self.answer.wait()
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nConnection: close\r\n\r\nok\n")
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            pass
        finally:
            self.writers.discard(writer)
            writer.close()


@pytest.fixture
async def node() -> AsyncIterator[tuple[HoldingNode, str, int]]:
    host = HOSTS[9]
    port = pick_node_port([host])
    holding = HoldingNode()
    holding.server = await asyncio.start_server(holding._serve, host, port)
    try:
        yield holding, host, port
    finally:
        holding.server.close()
        holding.answer.set()
        for writer in list(holding.writers):
            writer.transport.abort()
        await holding.server.wait_closed()


async def negotiated_pair(on_open: OpenHandler, agent_speaks: tuple[int, ...]
                          ) -> tuple[Tunnel, Tunnel, list[asyncio.Task[None]]]:
    """Gateway and agent sessions built by the handshake (the agent offering ``agent_speaks``), joined in memory."""
    now = asyncio.get_running_loop().time()
    ag_core = handshake.ClientConnection(wire.Hello("agent-v-1", "s" * 32, agent_speaks))
    gw_core = handshake.ServerConnection(wire.DEFAULT_LIMITS)
    hello = gw_core.receive_hello(ag_core.data_to_send()[0])
    gw_core.accept(wire.Welcome(handshake.choose_version(hello.versions), "gw-0", 1, 5.0, 15.0), now)
    ag_core.receive_welcome(gw_core.data_to_send()[0], now, agent_speaks)
    to_agent: asyncio.Queue[bytes | None] = asyncio.Queue()
    to_gateway: asyncio.Queue[bytes | None] = asyncio.Queue()
    gw = Tunnel(QueueSink(to_agent), gw_core, name="gw")
    ag = Tunnel(QueueSink(to_gateway), ag_core, name="ag", on_open=on_open)
    tasks = [asyncio.create_task(gw.run(drain(to_gateway))), asyncio.create_task(ag.run(drain(to_agent)))]
    return gw, ag, tasks


def scrape(port: int, deadline_ms: int) -> Open:
    return Open(0, wire.StreamKind.HTTP, NODE, port, "GET", "/metrics", (("Host", f"{NODE}:{port}"),), True,
                OpenFields(deadline_ms, "client-1"))


@pytest.mark.parametrize(("agent_speaks", "version"), [((1, 2, 3), 3), ((1, 2), 2), ((1,), 1)])
async def test_a_scrape_and_its_deadline_reach_the_agent(node: tuple[HoldingNode, str, int],
                                                         agent_speaks: tuple[int, ...], version: int) -> None:
    holding, host, port = node
    metrics = AgentMetrics()
    forwarder = Forwarder(lambda: {NODE: host}, Policy(frozenset([port]), frozenset(["GET"]), False, AGENT_TIMEOUT),
                          metrics, connect_timeout=5, connections_per_node=1, draining=lambda: False,
                          client_share=1.0)
    gw, ag, tasks = await negotiated_pair(forwarder.on_open, agent_speaks)
    try:
        assert gw.core.version == ag.core.version == version
        held = gw.open_stream(scrape(port, 30_000))  # takes the node's only upstream slot
        await eventually(lambda: len(holding.heads) == 1, timeout=10, what="the first request at the node")
        late = gw.open_stream(scrape(port, 300))  # waits in the agent's queue for 0.3 s, not the agent's 60 s
        with pytest.raises(StreamReset) as info:
            await asyncio.wait_for(late.head(), 20)
        assert info.value.code == wire.ResetCode.TIMEOUT, info.value
        assert f"waited 0.3s for a connection to node {NODE}" in info.value.reason, info.value.reason
        holding.answer.set()
        head = await asyncio.wait_for(held.head(), 10)
        body = b""
        while chunk := await asyncio.wait_for(held.read(), 10):
            body += bytes(chunk)
        assert (head.status, body) == (200, b"ok\n")
        assert len(holding.heads) == 1  # the late one was never dialled
        assert b"x-raven" not in holding.heads[0].lower(), holding.heads[0]
        refused = metrics.registry.get_sample_value("raven_agent_refused_streams_total", {"reason": "queue-timeout"})
        assert refused == 1
    finally:
        await forwarder.close()
        for session in (gw, ag):
            await session.close("test over")
        await asyncio.gather(*tasks, return_exceptions=True)
