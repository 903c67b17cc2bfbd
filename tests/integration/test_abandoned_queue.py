"""Requests abandoned while they wait for a node's upstream slot are dropped, never dialled.

A node that counts the connections it accepts holds every request until the test lets it answer (with
``Connection: close``, so no connection is reused and every dial shows). Clients fill the node's slots, more wait
in the agent's fair queue, the waiting ones leave: the node must accept no more connections than the slots
that were in use. Through a real gateway and agent (clients leave by closing their sockets: the waiting ones, or
every one at once, when the RESETs reach the agent over several messages), and with the agent's forwarder driven
in process (a RESET in the same message as its OPEN; RESETs of one burst in two messages 30 ms apart).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from agent.checks import Policy
from agent.forwarder import Forwarder
from raven.demo.launch import LocalCluster, PoolSpec
from raven.demo.simexporter import SimNode
from raven.ops.metrics import AgentMetrics
from raven.protocol import wire
from tests.support.cluster import HOSTS, pick_node_port
from tests.support.memsession import frames, pair
from tests.support.metrics import metric_values
from tests.support.polling import eventually

pytestmark = [pytest.mark.asyncio, pytest.mark.integration]

SLOTS = 2  # the agent's upstream connections per node
QUEUED = 6  # requests that wait for one of them, then leave


@dataclass
class CountingNode:
    """A node that counts accepted connections and answers each request only once ``answer`` is set."""

    accepted: int = 0
    requests: int = 0
    answer: asyncio.Event = field(default_factory=asyncio.Event)
    server: asyncio.Server | None = None
    handlers: set[asyncio.Task[None]] = field(default_factory=set)
    writers: set[asyncio.StreamWriter] = field(default_factory=set)

    async def start(self, host: str, port: int) -> None:
        self.server = await asyncio.start_server(self._serve, host, port)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        task = asyncio.current_task()
        assert task is not None
        self.handlers.add(task)
        self.writers.add(writer)
        try:
            await reader.readuntil(b"\r\n\r\n")
            self.requests += 1
            await self.answer.wait()
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nConnection: close\r\n\r\nok\n")
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            pass
        finally:
            self.handlers.discard(task)
            self.writers.discard(writer)
            writer.close()

    async def close(self) -> None:
        """Stop: every held request is answered, every connection closed (a handler waiting for a head sees EOF)."""
        if self.server is not None:
            self.server.close()
        self.answer.set()
        for writer in list(self.writers):
            writer.transport.abort()
        async with asyncio.timeout(10):
            await asyncio.gather(*self.handlers, return_exceptions=True)
            if self.server is not None:
                await self.server.wait_closed()


@pytest.fixture
async def node() -> AsyncIterator[tuple[CountingNode, str, int]]:
    host = HOSTS[8]
    port = pick_node_port([host])
    counting = CountingNode()
    await counting.start(host, port)
    try:
        yield counting, host, port
    finally:
        await counting.close()


async def _send(front: str, port: int, node: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, _, front_port = front.removeprefix("http://").rpartition(":")
    reader, writer = await asyncio.open_connection(host, int(front_port))
    writer.write(f"GET /metrics HTTP/1.1\r\nHost: {node}:{port}\r\nConnection: close\r\n\r\n".encode())
    await writer.drain()
    return reader, writer


@dataclass
class QueuedNode:
    """A cluster whose one node holds ``slots`` requests of one client unanswered, and ``queued`` more waiting in
    the agent's queue behind them; ``clients`` are their connections (aborted at the end, whatever happened)."""

    cluster: LocalCluster
    metrics_port: int
    clients: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]

    async def streams(self) -> float:
        return sum((await metric_values(self.metrics_port, "raven_agent_streams_in_flight")).values())

    async def wait_streams(self, n: int, what: str) -> None:
        async def there() -> bool:
            return await self.streams() == n

        await eventually(there, timeout=15, what=what)


@contextlib.asynccontextmanager
async def queued_node(tmp_path: Path, node: tuple[CountingNode, str, int], slots: int,
                      queued: int) -> AsyncIterator[QueuedNode]:
    counting, host, port = node
    cluster = LocalCluster(
        tmp_path, [PoolSpec("pool-q", [SimNode("edge-q-1", host, port)], agents=1)], allowed_ports=[port],
        # Every client of these tests comes from one address: its share of the node is all of the node's slots.
        agent_settings={"upstream_connections_per_node": slots, "upstream_client_share": 1.0},
        gateway_settings={"front": {"client_share": 1.0}},
    )
    clients: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    try:
        await cluster.start()
        q = QueuedNode(cluster, next(iter(cluster.agents.values())).metrics_port, clients)
        for _ in range(slots):
            clients.append(await _send(cluster.front_url, port, "edge-q-1"))
        await eventually(lambda: counting.requests == slots, timeout=15, what="the node's slots in use")
        for _ in range(queued):
            clients.append(await _send(cluster.front_url, port, "edge-q-1"))
        await q.wait_streams(slots + queued, "requests waiting in the agent's queue")
        yield q
    finally:
        for _, writer in clients:
            writer.transport.abort()
        await cluster.close()


async def test_clients_that_leave_the_queue_cost_the_node_no_connection(
    tmp_path: Path, node: tuple[CountingNode, str, int]
) -> None:
    counting = node[0]
    async with queued_node(tmp_path, node, SLOTS, QUEUED) as q:
        for _, writer in q.clients[SLOTS:]:
            writer.transport.abort()  # the waiting clients leave
        await q.wait_streams(SLOTS, "the abandoned requests gone from the agent")
        counting.answer.set()
        for reader, _ in q.clients[:SLOTS]:
            async with asyncio.timeout(15):
                answer = await reader.read()
            assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
        await q.wait_streams(0, "the agent idle")
        assert counting.accepted == SLOTS, f"{counting.accepted} connections for {SLOTS} slots in use"
        requests = await metric_values(q.metrics_port, "raven_agent_requests_total")
        assert sum(v for labels, v in requests.items() if ("code", "200") in labels) == SLOTS, requests


EVERYONE_SLOTS = 16  # the agent's default upstream connections per node
EVERYONE_QUEUED = 48  # the agent's queue holds 4 per slot; with the slots, the gateway's max_streams_per_node


async def test_clients_that_all_leave_at_once_cost_the_node_no_dial(
    tmp_path: Path, node: tuple[CountingNode, str, int]
) -> None:
    """Every client leaves at once, those holding the node's slots and those queued behind them: their RESETs reach
    the agent over several messages, and a slot freed by an early one must not go to a queued request whose own
    RESET is still on its way (found by issue 29, item 7: 10 of 58 such requests were dialled)."""
    counting, _, port = node
    async with queued_node(tmp_path, node, EVERYONE_SLOTS, EVERYONE_QUEUED) as q:
        for _, writer in q.clients:
            writer.transport.abort()  # every client leaves, in one turn of this loop
        await q.wait_streams(0, "every request gone from the agent")
        dialled = counting.accepted - EVERYONE_SLOTS
        assert dialled == 0, f"{dialled} of {EVERYONE_QUEUED} abandoned requests were dialled"
        requests = await metric_values(q.metrics_port, "raven_agent_requests_total")
        assert requests.get((("code", "abandoned"), ("kind", "http"))) == EVERYONE_QUEUED, requests

        # A normal scrape still gets its slot and its answer.
        counting.answer.set()
        reader, writer = await _send(q.cluster.front_url, port, "edge-q-1")
        q.clients.append((reader, writer))
        async with asyncio.timeout(15):
            answer = await reader.read()
        assert answer.startswith(b"HTTP/1.1 200"), answer[:200]


def _policy(port: int) -> Policy:
    return Policy(frozenset([port]), frozenset(["GET"]), False, 10.0)


async def test_a_stream_reset_before_it_is_served_is_never_dialled(node: tuple[CountingNode, str, int]) -> None:
    """The OPEN and its RESET in one message (a client that left at once), for a free slot and for a queued one:
    the forwarder learns of the RESET before the task that serves the stream first runs."""
    counting, host, port = node
    metrics = AgentMetrics()

    def abandoned() -> float:
        labels = {"kind": "http", "code": "abandoned"}
        return metrics.registry.get_sample_value("raven_agent_requests_total", labels) or 0.0

    forwarder = Forwarder(lambda: {"edge-q-1": host}, _policy(port), metrics, connect_timeout=5,
                          connections_per_node=1, draining=lambda: False, client_share=1.0)
    gw, ag, tasks = await pair(forwarder.on_open)
    try:
        head = (("host", f"edge-q-1:{port}"),)
        opened = wire.Open(0, wire.StreamKind.HTTP, "edge-q-1", port, "GET", "/metrics", head, True)
        gone = gw.open_stream(opened)
        gone.reset(wire.ResetCode.CANCEL, "the client left")  # queued behind its OPEN: one message
        await eventually(lambda: abandoned() == 1, timeout=5, what="the reset stream dropped")
        await eventually(lambda: not forwarder.tasks, timeout=5, what="the reset stream forgotten")
        sent = frames(gw.sink.sent)  # type: ignore[attr-defined]
        assert [type(f) for f in sent] == [wire.Open, wire.Reset]  # both reached the agent, in one message
        held = gw.open_stream(opened)  # takes the only slot
        await eventually(lambda: counting.requests == 1, timeout=5, what="the slot in use")
        # The node accepts in order: a connection dialled for the reset stream would have been counted first.
        assert counting.accepted == 1
        waiting = [gw.open_stream(opened) for _ in range(3)]
        await eventually(lambda: len(forwarder.tasks) == 4, timeout=5, what="streams queued")
        for stream in waiting:
            stream.reset(wire.ResetCode.CANCEL, "the client left")
        held.reset(wire.ResetCode.CANCEL, "the client left")  # frees the slot in the same message
        await eventually(lambda: not forwarder.tasks, timeout=5, what="every stream ended")
        assert counting.accepted == 1
        assert abandoned() == 4
        assert forwarder._slots == {}  # no slot held, nobody waiting: the node's queue is gone
    finally:
        await forwarder.close()
        for session in (gw, ag):
            await session.close("test over")
        await asyncio.gather(*tasks, return_exceptions=True)


async def test_resets_spread_over_messages_never_dial_a_queued_request(node: tuple[CountingNode, str, int]) -> None:
    """The RESETs of clients that left together, in two messages 30 ms apart (the gateway notices each departure in
    its own turn): the first frees the node's slots, the second says the queued requests are gone too. The freed
    slots wait for the burst to settle and go to nobody: the node is dialled for no request that was abandoned."""
    counting, host, port = node
    metrics = AgentMetrics()
    forwarder = Forwarder(lambda: {"edge-q-1": host}, _policy(port), metrics, connect_timeout=5,
                          connections_per_node=2, draining=lambda: False, client_share=1.0)
    gw, ag, tasks = await pair(forwarder.on_open)
    try:
        head = (("host", f"edge-q-1:{port}"),)
        opened = wire.Open(0, wire.StreamKind.HTTP, "edge-q-1", port, "GET", "/metrics", head, True)
        held = [gw.open_stream(opened) for _ in range(2)]
        await eventually(lambda: counting.requests == 2, timeout=5, what="the slots in use")
        waiting = [gw.open_stream(opened) for _ in range(4)]
        await eventually(lambda: len(forwarder.tasks) == 6, timeout=5, what="streams queued")
        messages = len(gw.sink.sent)  # type: ignore[attr-defined]
        for stream in held:
            stream.reset(wire.ResetCode.CANCEL, "the client left")
        await asyncio.sleep(0.03)
        for stream in waiting:
            stream.reset(wire.ResetCode.CANCEL, "the client left")
        await eventually(lambda: not forwarder.tasks, timeout=5, what="every stream ended")
        sent = gw.sink.sent[messages:]  # type: ignore[attr-defined]
        assert [len(frames([m])) for m in sent] == [2, 4], "the RESETs were not in two messages"
        assert counting.accepted == 2, f"{counting.accepted - 2} abandoned requests dialled"
        labels = {"kind": "http", "code": "abandoned"}
        assert metrics.registry.get_sample_value("raven_agent_requests_total", labels) == 4

        # A live request still gets a slot and its answer.
        counting.answer.set()
        live = gw.open_stream(opened)
        async with asyncio.timeout(5):
            answer = await live.head()
        assert answer.status == 200
        async with asyncio.timeout(5):
            assert bytes(await live.read()) == b"ok\n"
    finally:
        await forwarder.close()
        for session in (gw, ag):
            await session.close("test over")
        await asyncio.gather(*tasks, return_exceptions=True)
