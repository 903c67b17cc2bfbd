"""A hand-written agent for attacking the tunnel port: a valid agent certificate, wire frames by hand; and
agent certificates the CA signs as given (:func:`sign_agent_as_given`), names unchecked, as another CA may."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from pathlib import Path

import aiohttp
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from raven import pki
from raven.config import TLSConfig
from raven.demo.launch import LocalCluster
from raven.pki.authority import sign_leaf
from raven.protocol import wire
from raven.transport.tls import client_context


def sign_agent_as_given(certs: Path, file_name: str, agent: str, pools: Sequence[str]) -> None:
    """An agent certificate signed by the CA in ``certs`` whose agent name (URI and common name) and pools are
    exactly what is given, CR LF and escapes included: what cert-manager or another team's CA signs when asked.
    Written as ``<file_name>.pem`` and ``<file_name>-key.pem`` beside the CA."""
    sans: list[x509.GeneralName] = [x509.UniformResourceIdentifier(pki.AGENT_URI_PREFIX + agent)]
    sans += [x509.UniformResourceIdentifier(pki.POOL_URI_PREFIX + p) for p in pools]
    sign_leaf(certs, certs, file_name, agent, sans, ExtendedKeyUsageOID.CLIENT_AUTH, days=2)


class Peer:
    """A hand-written agent: TLS with a valid agent certificate, wire frames by hand."""

    def __init__(self, cluster: LocalCluster, identity: str, agent: str | None = None, source: str = "") -> None:
        """``identity``: the certificate's file name in the cluster's certificates; ``agent``: the name HELLO
        gives (default: ``identity``); ``source``: the local address to connect from (the gateway rate-limits
        its log lines per source)."""
        certs = cluster.certs
        self.ctx = client_context(TLSConfig(cert=certs / f"{identity}.pem", key=certs / f"{identity}-key.pem",
                                            ca=certs / "ca.pem"))
        self.ctx.check_hostname = False
        self.url = f"wss://127.0.0.1:{cluster.tunnel_port}/tunnel"
        self.identity = identity
        self.source = source
        self.agent = identity if agent is None else agent
        self.http: aiohttp.ClientSession | None = None
        self.ws: aiohttp.ClientWebSocketResponse | None = None

    async def __aenter__(self) -> Peer:
        connector = aiohttp.TCPConnector(local_addr=(self.source, 0)) if self.source else None
        self.http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10), connector=connector)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.ws is not None:
            await self.ws.close()
        if self.http is not None:
            await self.http.close()

    async def connect(self, session: str | None = None, headers: dict[str, str] | None = None) -> wire.Frame:
        """HELLO (with ``session`` as its session id, default a fresh UUID); returns the gateway's answer (WELCOME
        or GOAWAY). ``headers``: added to the upgrade request (a ``Date``, say)."""
        assert self.http is not None
        self.ws = await self.http.ws_connect(self.url, ssl=self.ctx, max_msg_size=4 << 20, headers=headers)
        hello = wire.Hello(self.agent, uuid.uuid4().hex if session is None else session, versions=(1,))
        await self.ws.send_bytes(wire.encode(hello))
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
