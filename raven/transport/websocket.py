"""Carry a session over an aiohttp WebSocket (either side): binary messages only (one frame each in protocol
version 1, a batch of frames in version 2).

The services' tunnels no longer run on aiohttp's reader and writer (raven/transport/wslink.py takes the
connection over after the Upgrade); this stays for tools and tests that drive a session over an aiohttp
WebSocket (bench/bench_agents.py, tests/support): :class:`WebSocketSink` is the same channel as a link."""

from __future__ import annotations

from typing import Any

import aiohttp
from aiohttp import web
from mypy_extensions import mypyc_attr

from raven.errors import RavenError

WebSocket = web.WebSocketResponse | aiohttp.ClientWebSocketResponse


class WebSocketSink:
    __slots__ = ("ws",)

    def __init__(self, ws: WebSocket) -> None:
        self.ws = ws

    async def send(self, message: bytes) -> None:
        await self.ws.send_bytes(message)

    async def send_many(self, messages: list[bytes]) -> None:
        for message in messages:
            await self.ws.send_bytes(message)

    async def receive(self) -> bytes:
        """One binary message (the handshake's); :class:`TransportError` for anything else."""
        try:
            return await anext(messages(self.ws))
        except StopAsyncIteration:
            raise TransportError("websocket closed") from None

    async def close(self) -> None:
        await self.ws.close()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self.ws.get_extra_info(name, default)


@mypyc_attr(native_class=False)  # two exception bases: an ordinary class when compiled
class TransportError(RavenError, ConnectionError):
    """The WebSocket under a session broke (an error, or a message type a session does not carry). A
    ``ConnectionError`` too: ``Tunnel.run`` ends the session on it as on any lost connection."""


class messages:
    """Binary messages until the WebSocket closes; anything else ends the session with a reason.

    A class rather than an async generator: an idle session waits in here for its whole life, and a generator
    keeps its frame and an awaitable wrapper alive on top of the one pending receive (memory per session).
    """

    __slots__ = ("ws",)

    def __init__(self, ws: WebSocket) -> None:
        self.ws = ws

    def __aiter__(self) -> messages:
        return self

    async def __anext__(self) -> bytes:
        msg = await self.ws.receive()
        if msg.type == aiohttp.WSMsgType.BINARY:
            data: bytes = msg.data
            return data
        if msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSING, aiohttp.WSMsgType.CLOSED):
            raise StopAsyncIteration
        if msg.type == aiohttp.WSMsgType.ERROR:
            raise TransportError(f"websocket error: {self.ws.exception()!r}")
        raise TransportError(f"unexpected websocket message type {msg.type.name}")
