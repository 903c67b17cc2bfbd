"""A hand-written agent for attacking the tunnel port: a valid agent certificate, wire frames by hand."""

from __future__ import annotations

import uuid

import aiohttp

from raven.config import TLSConfig
from raven.demo.launch import LocalCluster
from raven.protocol import wire
from raven.transport.tls import client_context


class Peer:
    """A hand-written agent: TLS with a valid agent certificate, wire frames by hand."""

    def __init__(self, cluster: LocalCluster, identity: str) -> None:
        certs = cluster.certs
        self.ctx = client_context(TLSConfig(cert=certs / f"{identity}.pem", key=certs / f"{identity}-key.pem",
                                            ca=certs / "ca.pem"))
        self.ctx.check_hostname = False
        self.url = f"wss://127.0.0.1:{cluster.tunnel_port}/tunnel"
        self.identity = identity
        self.http: aiohttp.ClientSession | None = None
        self.ws: aiohttp.ClientWebSocketResponse | None = None

    async def __aenter__(self) -> Peer:
        self.http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.ws is not None:
            await self.ws.close()
        if self.http is not None:
            await self.http.close()

    async def connect(self) -> wire.Frame:
        """HELLO; returns the gateway's answer (WELCOME or GOAWAY)."""
        assert self.http is not None
        self.ws = await self.http.ws_connect(self.url, ssl=self.ctx, max_msg_size=4 << 20)
        await self.ws.send_bytes(wire.encode(wire.Hello(self.identity, uuid.uuid4().hex, versions=(1,))))
        return await self.receive()

    async def receive(self, timeout: float = 10) -> wire.Frame:
        assert self.ws is not None
        msg = await self.ws.receive(timeout=timeout)
        if msg.type != aiohttp.WSMsgType.BINARY:
            raise ConnectionError(f"session ended: {msg.type.name} {msg.extra or ''}")
        return wire.decode(msg.data, wire.Limits(max_frame=4 << 20))

    async def control(self, timeout: float = 10) -> wire.Frame:
        """The next frame that is not a PING (answered)."""
        while True:
            frame = await self.receive(timeout)
            if isinstance(frame, wire.Ping):
                assert self.ws is not None
                await self.ws.send_bytes(wire.encode(wire.Pong(frame.opaque)))
                continue
            return frame

    async def send(self, data: bytes) -> None:
        assert self.ws is not None
        await self.ws.send_bytes(data)
