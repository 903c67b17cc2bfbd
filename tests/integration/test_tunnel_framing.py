"""The gateway's tunnel port against an agent (a valid certificate) that breaks RFC 6455 after its session is
open: an unmasked frame, a length over the message limit, an unknown opcode, a fragmented control frame. Each is
refused by the gateway's framing in the core (raven/transport/wslink.py) with a close frame carrying the code and
the reason, said in the gateway's log, and the well-behaved agent's scrape through its own session goes on."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
import pytest
import pytest_asyncio

from raven.demo.launch import LocalCluster, PoolSpec
from raven.demo.simexporter import SimExporter, SimNode
from raven.protocol import wire
from tests.support.agentpeer import Peer
from tests.support.cluster import HOSTS, pick_node_port
from tests.support.polling import eventually
from tests.support.wsframes import raw_frame

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.integration]

MAX_FRAME = 256 * 1024


@dataclass
class Bed:
    cluster: LocalCluster
    port: int

    async def scrape(self) -> None:
        url = f"http://127.0.0.1:{self.cluster.front_port}/metrics"
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
            async with http.get(url, headers={"Host": f"frm-1:{self.port}"}) as resp:
                assert resp.status == 200, await resp.text()

    def gateway_log(self) -> str:
        gateway = self.cluster.gateway
        assert gateway is not None
        return gateway.log.read_text(errors="replace")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def bed(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Bed]:
    port = pick_node_port(HOSTS)
    node = SimNode("frm-1", HOSTS[0], port)
    exporter = SimExporter([node])
    await exporter.start()
    cluster = LocalCluster(
        tmp_path_factory.mktemp("tunnel-framing"), [PoolSpec("pool-f", [node], agents=2)], allowed_ports=[port],
        gateway_settings={"session_burst": 20, "limits": {"max_frame": MAX_FRAME}},
    )
    try:
        cluster.make_pki()
        await cluster.start_gateway()
        await cluster.start_agent(cluster.pools[0], "agent-pool-f-1")  # the well-behaved agent
        await cluster.wait_registered(30, agents_per_node=1)
        yield Bed(cluster, port)
    finally:
        await cluster.close()
        await exporter.close()


def frame(opcode: int, payload: bytes, *, fin: bool = True, mask: bool = True, length: int | None = None) -> bytes:
    """A client's frame written by hand (masked, as a client's must be, unless it is the rule being broken)."""
    return raw_frame(opcode, payload, fin=fin, mask=mask, length=length)


def transport_of(ws: aiohttp.ClientWebSocketResponse) -> asyncio.Transport:
    conn = ws._response.connection
    assert conn is not None and conn.transport is not None
    return conn.transport


async def close_frame(peer: Peer) -> aiohttp.WSMessage:
    """The gateway's close frame (its PINGs before it skipped)."""
    assert peer.ws is not None
    while True:
        msg = await peer.ws.receive(timeout=10)
        if msg.type != aiohttp.WSMsgType.BINARY:
            return msg


@pytest.mark.parametrize(("name", "bad", "code", "reason"), [
    ("unmasked", frame(0x2, wire.encode(wire.Ping(7)), mask=False), 1002, "unmasked frame from the client"),
    ("oversize", frame(0x2, b"", length=1 << 40), 1009, f"(limit {MAX_FRAME}, limits.max_frame)"),
    ("opcode", frame(0x3, b"x"), 1002, "unknown opcode 0x3"),
    ("fragmented-ping", frame(0x9, b"p", fin=False), 1002, "fragmented control frame (opcode 0x9)"),
], ids=["unmasked", "oversize", "opcode", "fragmented-ping"])  # a masked frame's key is random: xdist needs fixed ids
async def test_a_frame_against_rfc_6455_is_refused_with_a_reason(bed: Bed, name: str, bad: bytes, code: int,
                                                                  reason: str) -> None:
    async with Peer(bed.cluster, "agent-pool-f-2") as peer:
        answer = await peer.connect()
        assert isinstance(answer, wire.Welcome), answer
        assert peer.ws is not None
        transport_of(peer.ws).write(bad + os.urandom(64))  # garbage after it is never read
        msg = await close_frame(peer)
        assert msg.type == aiohttp.WSMsgType.CLOSE, msg
        assert msg.data == code and reason in (msg.extra or ""), (msg.data, msg.extra)

    def logged() -> bool:
        return any("websocket protocol error from the peer: " in line and reason in line
                   for line in bed.gateway_log().splitlines())

    await eventually(logged, timeout=5, what="the refusal in the gateway's log")
    await bed.scrape()  # the well-behaved agent's session was not touched


async def test_a_bad_frame_before_hello_is_refused_too(bed: Bed) -> None:
    async with Peer(bed.cluster, "agent-pool-f-2") as peer:
        assert peer.http is not None
        peer.ws = await peer.http.ws_connect(peer.url, ssl=peer.ctx)
        transport_of(peer.ws).write(frame(0x2, b"hello", mask=False))
        msg = await close_frame(peer)
        assert msg.type == aiohttp.WSMsgType.CLOSE and msg.data == 1002
        assert "unmasked frame from the client" in (msg.extra or "")
    await bed.scrape()
