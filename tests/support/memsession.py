"""Two asyncio sessions joined back to back in memory, for unit tests of the transport layer."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from raven.protocol import connection as core
from raven.protocol import wire
from raven.protocol.handshake import ClientConnection, ServerConnection
from raven.transport.tunnel import OpenHandler, Tunnel


class QueueSink:
    def __init__(self, queue: asyncio.Queue[bytes | None]) -> None:
        self.queue = queue
        self.sent: list[bytes] = []

    async def send(self, message: bytes) -> None:
        self.sent.append(message)
        await self.queue.put(message)

    async def send_many(self, messages: list[bytes]) -> None:
        for message in messages:
            await self.send(message)

    async def close(self) -> None:
        await self.queue.put(None)


async def drain(queue: asyncio.Queue[bytes | None]) -> AsyncIterator[bytes]:
    while True:
        item = await queue.get()
        if item is None:
            return
        yield item


async def pair(
    on_open: OpenHandler, window: int = 64 * 1024, heartbeat: tuple[float, float] = (5.0, 15.0)
) -> tuple[Tunnel, Tunnel, list[asyncio.Task[None]]]:
    to_agent: asyncio.Queue[bytes | None] = asyncio.Queue()
    to_gateway: asyncio.Queue[bytes | None] = asyncio.Queue()
    gw = Tunnel(QueueSink(to_agent), core_session(True, window, heartbeat), name="gw")
    ag = Tunnel(QueueSink(to_gateway), core_session(False, window, heartbeat), name="ag", on_open=on_open)
    tasks = [asyncio.create_task(gw.run(drain(to_gateway))), asyncio.create_task(ag.run(drain(to_agent)))]
    return gw, ag, tasks


def core_pair(window: int = 64 * 1024, max_streams: int = 64, *, version: int = wire.PROTOCOL_VERSION,
              heartbeat: tuple[float, float] = (5.0, 15.0), limits: wire.Limits = wire.DEFAULT_LIMITS,
              now: float = 0.0) -> tuple[ServerConnection, ClientConnection]:
    """The gateway's and the agent's cores after a real HELLO/WELCOME between them in memory: both OPEN on the same
    numbers seen from each end (``window``, ``max_streams``, ``version``, ``heartbeat`` counted from ``now``)."""
    agent = ClientConnection(wire.Hello("agent-1", "s" * 32, (version,), window, max_streams), limits, now)
    gateway = ServerConnection(limits, now)
    (hello,) = agent.data_to_send()
    gateway.receive_hello(hello)
    gateway.accept(wire.Welcome(version, "gw-0", 1, heartbeat[0], heartbeat[1], window, max_streams), now)
    (welcome,) = gateway.data_to_send()
    agent.receive_welcome(welcome, now)
    return gateway, agent


def core_session(opener: bool, window: int = 64 * 1024, heartbeat: tuple[float, float] = (5.0, 15.0),
                 max_streams: int = 64) -> core.Connection:
    """One side of :func:`core_pair` (the gateway's if ``opener``), its heartbeat counted from now."""
    gateway, agent = core_pair(window, max_streams, heartbeat=heartbeat, now=asyncio.get_running_loop().time())
    return gateway if opener else agent


def batched(*frames: bytes) -> bytes:
    """Encoded frames as one version-2 message."""
    return b"".join(wire.length_prefix(len(f)) + f for f in frames)


def frames(messages: list[bytes]) -> list[wire.Frame]:
    """Every frame in a list of version-2 messages."""
    return [wire.decode(raw) for m in messages for raw in wire.split_batch(m)]


def http_open(node: str = "edge-1", port: int = 9400) -> wire.Open:
    return wire.Open(0, wire.StreamKind.HTTP, node, port, "GET", "/metrics", (("host", f"{node}:{port}"),), True)
