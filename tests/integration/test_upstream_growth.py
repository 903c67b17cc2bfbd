"""The agent's pool of connections to nodes tells the agent when its keep-alive connections grew by a step.

The agent freezes such connections' objects out of the garbage collector's way when told (``on_grown`` ->
``raven.ops.gcpause.settle_soon``), as the gateway does for its front end's (test_listener_growth.py): an agent
holds one keep-alive connection per node, up to ~1,000, and without it every full collection walked them all.
Real connections to a loopback server; churn below the high-water mark is not reported.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from agent.upstream import Response, UpstreamPool
from raven.http.guard import GROWTH_STEP
from tests.support.polling import eventually

pytestmark = [pytest.mark.asyncio, pytest.mark.integration]

HOST = "127.0.0.1"
HELD = GROWTH_STEP + 44  # one step and a little, well under the default open-files limit (both ends here)


class KeepAliveServer:
    """Answers every request on a connection with a 2-byte body, keeps the connection; can close some of them."""

    def __init__(self) -> None:
        self.writers: list[asyncio.StreamWriter] = []
        self.handlers: set[asyncio.Task[None] | None] = set()
        self.server: asyncio.Server | None = None
        self.port = 0

    async def start(self) -> KeepAliveServer:
        self.server = await asyncio.start_server(self._serve, HOST, 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writers.append(writer)
        self.handlers.add(asyncio.current_task())
        try:
            while True:
                await reader.readuntil(b"\r\n\r\n")
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        finally:
            with contextlib.suppress(ValueError):
                self.writers.remove(writer)
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
            self.handlers.discard(asyncio.current_task())

    def drop(self, count: int) -> None:
        """Close ``count`` of the connections from this end (the pool sees them closed)."""
        for writer in self.writers[:count]:
            writer.close()

    async def close(self) -> None:
        """Close every connection and wait until each one's handler has finished."""
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()
        self.drop(len(self.writers))
        await eventually(lambda: not self.handlers, 10, what="every connection's handler finished")


async def at_once(pool: UpstreamPool, server: KeepAliveServer, count: int) -> None:
    """``count`` requests in flight together (each needs its own connection), then all answered and released:
    the connections stay open, idle in the pool."""
    responses: list[Response] = await asyncio.gather(
        *(pool.request(HOST, server.port, "GET", "/metrics", ()) for _ in range(count)))
    for resp in responses:
        assert resp.status == 200
        assert await resp.read() == (b"ok", True)
        resp.release()


async def test_keep_alive_connections_growing_by_a_step_are_reported_churn_below_the_mark_not() -> None:
    grown: list[int] = []
    pool = UpstreamPool(connect_timeout=10.0, max_idle=2 * HELD, max_connections=4 * HELD)
    pool.on_grown = lambda: grown.append(pool.open_connections)
    server = await KeepAliveServer().start()
    try:
        await at_once(pool, server, GROWTH_STEP - 1)
        assert pool.open_connections == GROWTH_STEP - 1
        assert grown == []  # not a step yet
        await at_once(pool, server, HELD)  # the idle ones are reused, the rest are new
        assert pool.open_connections == HELD
        assert grown == [GROWTH_STEP]  # once, at the step, not per connection

        # Churn below the high-water mark: 100 connections close, 100 new ones open in their place.
        server.drop(100)
        await eventually(lambda: pool.open_connections == HELD - 100, 10, what="the pool sees them closed")
        await at_once(pool, server, HELD)
        assert pool.open_connections == HELD
        assert grown == [GROWTH_STEP]

        # All of them go; a new ramp is new long-lived state: reported again.
        server.drop(len(server.writers))
        await eventually(lambda: pool.open_connections == 0, 10, what="every connection closed")
        await at_once(pool, server, HELD)
        assert grown == [GROWTH_STEP, GROWTH_STEP]
    finally:
        await pool.close()
        await server.close()
    assert pool.open_connections == 0
