"""Carry a session over an aiohttp WebSocket (either side): one binary message, one frame."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web

WebSocket = web.WebSocketResponse | aiohttp.ClientWebSocketResponse


class WebSocketSink:
    __slots__ = ("ws",)

    def __init__(self, ws: WebSocket) -> None:
        self.ws = ws

    async def send(self, message: bytes) -> None:
        await self.ws.send_bytes(message)

    async def close(self) -> None:
        await self.ws.close()


class TransportError(ConnectionError):
    pass


async def messages(ws: WebSocket) -> AsyncIterator[bytes]:
    """Binary messages until the WebSocket closes; anything else ends the session with a reason."""
    while True:
        msg = await ws.receive()
        if msg.type == aiohttp.WSMsgType.BINARY:
            yield msg.data
        elif msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSING, aiohttp.WSMsgType.CLOSED):
            return
        elif msg.type == aiohttp.WSMsgType.ERROR:
            raise TransportError(f"websocket error: {ws.exception()!r}")
        else:
            raise TransportError(f"unexpected websocket message type {msg.type.name}")
