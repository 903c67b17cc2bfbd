"""A hand-written gateway's side of the tunnel handshake and session upkeep, for tests that drive a real agent.

It speaks protocol version 1 (one frame per message; the agent speaks both): HELLO is answered with the WELCOME the
test chooses, REGISTER with REGISTERED (every node accepted), PING with PONG; every other frame goes to the caller.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from raven.protocol import wire


async def serve_agent(ws: web.WebSocketResponse, welcome: wire.Welcome,
                      on_frame: Callable[[wire.Frame], Awaitable[None]] | None = None,
                      on_welcomed: Callable[[], None] | None = None) -> None:
    """Answer the agent's HELLO with ``welcome``, then keep its session until it closes."""
    hello = wire.decode(await ws.receive_bytes(timeout=10))
    assert isinstance(hello, wire.Hello)
    await ws.send_bytes(wire.encode(welcome))
    if on_welcomed is not None:
        on_welcomed()
    async for msg in ws:
        if msg.type != web.WSMsgType.BINARY:
            break
        frame = wire.decode(msg.data)
        if isinstance(frame, wire.Register):
            names = tuple(n.name for n in frame.nodes)
            await ws.send_bytes(wire.encode(wire.Registered(names, ())))
        elif isinstance(frame, wire.Ping):
            await ws.send_bytes(wire.encode(wire.Pong(frame.opaque)))
        elif on_frame is not None:
            await on_frame(frame)
