"""The guard tells its service when authenticated keep-alive connections grew by a step (real sockets).

The gateway freezes such connections' objects out of the garbage collector's way when told
(``on_grown`` -> ``raven.ops.gcpause.settle_soon``); without it every full collection walked 10,000
connections' objects. Connections that never authenticate are not long-lived state and do not count.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from aiohttp import web

from raven.demo.launch import free_port
from raven.http.guard import GROWTH_STEP, ConnectionGuard, GuardLimits
from raven.http.listener import GuardedSite, guarded_handler

pytestmark = [pytest.mark.asyncio, pytest.mark.integration]

HELD = GROWTH_STEP + 44  # one step and a little, well under the default open-files limit (both ends here)


async def hold(port: int, count: int, token: str) -> list[asyncio.StreamWriter]:
    """Open ``count`` keep-alive connections, one answered request each; return them still open."""
    writers = []
    for _ in range(count):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writers.append(writer)
        writer.write(f"GET / HTTP/1.1\r\nHost: x\r\nAuthorization: {token}\r\n\r\n".encode())
        await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        await asyncio.wait_for(reader.readexactly(2), 10)
    return writers


async def close_all(writers: list[asyncio.StreamWriter]) -> None:
    for w in writers:
        w.close()
    for w in writers:
        with contextlib.suppress(OSError):
            await w.wait_closed()


async def test_authenticated_connections_growing_by_a_step_are_reported_unauthenticated_ones_not() -> None:
    grown: list[int] = []
    guard = ConnectionGuard("test front", GuardLimits(max_unproven_per_client=2 * HELD, max_unproven=2 * HELD),
                            on_grown=lambda: grown.append(guard.connections - guard.unproven))

    async def handler(request: web.BaseRequest) -> web.StreamResponse:
        if request.headers.get("Authorization") == "good":
            assert guard.vouch(request) is None
        return web.Response(text="ok")

    runner = web.ServerRunner(web.Server(guarded_handler(guard, handler)))
    await runner.setup()
    port = free_port("127.0.0.1")
    site = GuardedSite(runner, "127.0.0.1", port, guard)
    await site.start()
    try:
        strangers = await hold(port, HELD, "bad")
        assert grown == []  # unauthenticated connections are not long-lived state
        await close_all(strangers)

        held = await hold(port, HELD, "good")
        assert grown == [GROWTH_STEP]  # once, at the step, not per connection
        await close_all(held)
        for _ in range(200):
            if guard.connections == 0:
                break
            await asyncio.sleep(0.05)
        assert guard.connections == 0

        held = await hold(port, HELD, "good")  # a new ramp after the connections went: reported again
        assert grown == [GROWTH_STEP, GROWTH_STEP]
        await close_all(held)
    finally:
        await runner.cleanup()
