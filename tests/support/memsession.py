"""Two asyncio sessions joined back to back in memory, for unit tests of the transport layer."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from raven.protocol import session as core
from raven.protocol import wire
from raven.transport.tunnel import OpenHandler, Tunnel


class QueueSink:
    def __init__(self, queue: asyncio.Queue[bytes | None]) -> None:
        self.queue = queue
        self.sent: list[bytes] = []

    async def send(self, message: bytes) -> None:
        self.sent.append(message)
        await self.queue.put(message)

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


def core_session(opener: bool, window: int = 64 * 1024, heartbeat: tuple[float, float] = (5.0, 15.0),
                 max_streams: int = 64) -> core.Session:
    """A ready core built from known numbers (what the handshake would agree), its heartbeat counted from now."""
    return core.Session(opener=opener, local_window=window, peer_window=window, local_max_streams=max_streams,
                        peer_max_streams=max_streams, heartbeat_interval=heartbeat[0], heartbeat_timeout=heartbeat[1],
                        now=asyncio.get_running_loop().time())


def batched(*frames: bytes) -> bytes:
    """Encoded frames as one version-2 message."""
    return b"".join(wire.length_prefix(len(f)) + f for f in frames)


def frames(messages: list[bytes]) -> list[wire.Frame]:
    """Every frame in a list of version-2 messages."""
    return [wire.decode(raw) for m in messages for raw in wire.split_batch(m)]


def http_open(node: str = "edge-1", port: int = 9400) -> wire.Open:
    return wire.Open(0, wire.StreamKind.HTTP, node, port, "GET", "/metrics", (("host", f"{node}:{port}"),), True)
