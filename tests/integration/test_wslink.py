"""The tunnel's WebSocket framing in the core (raven/transport/wslink.py, wsupgrade.py) over real TCP on loopback:
aiohttp does the Upgrade on both sides, then the links carry the bytes. Messages both ways and interop with
aiohttp's own reader and writer on the far side, the close handshake, pings, a server that masks (refused by the
agent's side), and a peer that stops reading (cut off by the session's write-stall deadline, and by the link's own
drain deadline)."""

from __future__ import annotations

import asyncio
import gc
import os
import socket
import struct
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web

from raven.protocol import wire
from raven.protocol.wsframe import OP_PING
from raven.transport.connect import accept, connect
from raven.transport.tunnel import Stream, Tunnel
from raven.transport.websocket import TransportError
from raven.transport.wslink import WsLink
from raven.transport.wsupgrade import TunnelResponse, take_over
from tests.support.memsession import batched, core_session
from tests.support.polling import eventually
from tests.support.wsframes import raw_frame

pytestmark = pytest.mark.asyncio

MAX = 1 << 20


@dataclass
class Server:
    """An aiohttp server whose one handler upgrades with TunnelResponse and hands each link to the test."""

    url: str = ""
    links: asyncio.Queue[WsLink] = field(default_factory=asyncio.Queue)
    responses: list[TunnelResponse] = field(default_factory=list)
    done: asyncio.Event = field(default_factory=asyncio.Event)  # handlers may return

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        ws = TunnelResponse(max_message=MAX)
        await ws.prepare(request)
        assert ws.link is not None
        self.responses.append(ws)
        await self.links.put(ws.link)
        await self.done.wait()
        return ws


@pytest_asyncio.fixture
async def server() -> AsyncIterator[Server]:
    srv = Server()
    runner = web.ServerRunner(web.Server(srv.handle))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    srv.url = f"http://127.0.0.1:{port}/tunnel"
    try:
        yield srv
    finally:
        srv.done.set()
        await runner.cleanup()


@pytest_asyncio.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


def transport_of(ws: aiohttp.ClientWebSocketResponse) -> asyncio.Transport:
    conn = ws._response.connection
    assert conn is not None and conn.transport is not None
    return conn.transport


async def test_messages_both_ways_between_two_links_and_a_clean_close(server: Server,
                                                                      http: aiohttp.ClientSession) -> None:
    ws = await http.ws_connect(server.url, compress=0)
    client = take_over(ws, max_message=MAX)
    srv = await asyncio.wait_for(server.links.get(), 5)
    big = os.urandom(300_000)  # masked by the client, unmasked by the server; several reads
    await client.send_many([b"hello", big, b""])
    assert [await srv.receive() for _ in range(3)] == [b"hello", big, b""]
    await srv.send_many([big, b"back"])
    assert await client.receive() == big and await client.receive() == b"back"
    await client.close()  # the close handshake: the server answers, both connections end
    with pytest.raises(TransportError, match="peer closed the websocket"):
        await asyncio.wait_for(srv.receive(), 5)
    await ws.close()  # aiohttp's response released; nothing left to send


async def test_aiohttp_on_the_far_side_interoperates(server: Server, http: aiohttp.ClientSession) -> None:
    """aiohttp's own client (reader and writer, autoping) against the server's link: messages, a ping answered
    with a pong, and the link's close seen by aiohttp as a close frame with the code and reason."""
    ws = await http.ws_connect(server.url, compress=0, autoping=False)
    srv = await asyncio.wait_for(server.links.get(), 5)
    await ws.send_bytes(b"x" * 70_000)
    assert await srv.receive() == b"x" * 70_000
    await ws.ping(b"are you there")
    msg = await ws.receive(timeout=5)
    assert msg.type == aiohttp.WSMsgType.PONG and msg.data == b"are you there"
    await srv.send_many([b"one", b"two"])
    assert (await ws.receive_bytes(timeout=5), await ws.receive_bytes(timeout=5)) == (b"one", b"two")
    closing = asyncio.create_task(srv.close(4000, "test over"))
    msg = await ws.receive(timeout=5)
    assert msg.type == aiohttp.WSMsgType.CLOSE and msg.data == 4000 and msg.extra == "test over"
    await ws.close()
    await asyncio.wait_for(closing, 5)
    assert ws.closed


async def test_a_masked_frame_from_the_server_is_refused_by_the_agents_side(server: Server,
                                                                           http: aiohttp.ClientSession) -> None:
    ws = await http.ws_connect(server.url, compress=0)
    client = take_over(ws, max_message=MAX)
    srv = await asyncio.wait_for(server.links.get(), 5)
    # A binary frame with the mask bit set, written by hand on the server's connection.
    srv.transport.write(struct.pack("!BB", 0x82, 0x80 | 3) + b"\0\0\0\0" + b"abc")
    with pytest.raises(TransportError, match="websocket protocol error from the peer: masked frame from the server"):
        await asyncio.wait_for(client.receive(), 5)
    # The server's side got the client's close frame with 1002 and the reason.
    with pytest.raises(TransportError, match=r"peer closed the websocket \(1002: websocket protocol error"):
        await asyncio.wait_for(srv.receive(), 5)
    await ws.close()


async def stalled_pair(server: Server, http: aiohttp.ClientSession
                       ) -> tuple[aiohttp.ClientWebSocketResponse, WsLink, asyncio.Transport]:
    """A server link whose client reads nothing more: small kernel buffers both ways, the client's reading paused."""
    ws = await http.ws_connect(server.url, compress=0, timeout=aiohttp.ClientWSTimeout(ws_close=1.0))
    srv = await asyncio.wait_for(server.links.get(), 5)
    client_transport = transport_of(ws)
    client_transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    srv.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    client_transport.pause_reading()
    return ws, srv, client_transport


async def test_a_peer_that_stops_reading_hits_the_sessions_write_stall_deadline(
        server: Server, http: aiohttp.ClientSession) -> None:
    """The peer keeps the session alive (it sends PINGs) but reads nothing: the session's writer waits (the
    kernel is full, then the transport's buffer) and the write-stall deadline (3 heartbeat timeouts) ends the
    session and cuts the connection; the transport's buffer never grows past what one wake-up wrote."""
    ws, srv, _ = await stalled_pair(server, http)
    session = Tunnel(srv, core_session(True, 1024, (0.1, 0.3), max_streams=1), name="deaf",
                     sock=srv.get_extra_info("socket"))
    serving = asyncio.create_task(srv.serve(session))
    loop = asyncio.get_running_loop()
    start = loop.time()
    ping = batched(wire.encode(wire.Ping(1)))
    most = 0
    try:
        while not session.closed and loop.time() - start < 10:
            await ws.send_bytes(ping)  # never silent: only the stalled write can end it
            for _ in range(50):
                session.send_control(wire.Drain("x" * 1000))
            most = max(most, srv.transport.get_write_buffer_size())
            await asyncio.sleep(0.02)
        await asyncio.wait_for(serving, 5)
        took = loop.time() - start  # ~1 s to the deadline, then the close handshake's 1.5 s unanswered
    finally:
        serving.cancel()
        await ws.close()
    assert "peer not reading: a write stalled" in session.close_reason
    assert took < 5
    assert srv.transport.is_closing()
    assert most < 4 << 20, most


async def test_the_links_own_drain_deadline_cuts_a_peer_that_does_not_read(server: Server,
                                                                           http: aiohttp.ClientSession) -> None:
    ws, srv, _ = await stalled_pair(server, http)
    srv.drain_timeout = 0.3
    loop = asyncio.get_running_loop()
    start = loop.time()
    try:
        with pytest.raises(TransportError, match=r"peer not reading: a write waited 0.3s"):
            for _ in range(1000):
                await asyncio.wait_for(srv.send_many([b"y" * 65536]), 5)
        assert loop.time() - start < 5
        await eventually(lambda: srv.transport.is_closing(), timeout=2, what="the connection cut")
        with pytest.raises(TransportError):
            await srv.send(b"more")  # a cut link sends nothing more
    finally:
        await ws.close()


def ping_flood(count: int) -> bytes:
    """``count`` full-size pings as a client sends them (masked): 131 bytes each."""
    return b"".join(raw_frame(OP_PING, b"p" * 125, mask=True) for _ in range(count))


async def flooded(server: Server, http: aiohttp.ClientSession, count: int
                  ) -> tuple[aiohttp.ClientWebSocketResponse, WsLink, asyncio.Transport, int]:
    """A peer that reads nothing (its kernel's receive buffer left as it is, the server's send buffer small) and
    sends ``count`` pings: the most the server's write buffer held meanwhile."""
    ws = await http.ws_connect(server.url, compress=0, timeout=aiohttp.ClientWSTimeout(ws_close=1.0))
    srv = await asyncio.wait_for(server.links.get(), 5)
    srv.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    client_transport = transport_of(ws)
    client_transport.pause_reading()
    most = 0
    flood = ping_flood(1000)
    for _ in range(count // 1000):
        client_transport.write(flood)  # the peer's own buffer takes what the server does not read
        await asyncio.sleep(0.01)
        most = max(most, srv.transport.get_write_buffer_size())
    for _ in range(50):
        await asyncio.sleep(0.01)
        most = max(most, srv.transport.get_write_buffer_size())
    return ws, srv, client_transport, most


async def test_a_peer_that_floods_pings_and_reads_nothing_cannot_grow_our_write_buffer(
        server: Server, http: aiohttp.ClientSession) -> None:
    """20,000 pings (2.6 MB) from a peer that reads nothing: the server holds one pong and stops reading once its
    writes are paused, so its write buffer stays near the high-water mark (every pong written was ~2.5 MB); when
    the peer reads again, the held pong goes out, reading resumes and a message gets through."""
    ws, srv, client_transport, most = await flooded(server, http, 20_000)
    try:
        assert most < 128 << 10, most
        assert not srv.transport.is_reading()
        assert srv.protocol.writing_paused
        assert not srv.transport.is_closing()
        client = take_over(ws, max_message=MAX)  # the peer reads again (the pongs it reads are ignored)
        client_transport.resume_reading()
        await client.send(b"after the flood")
        assert await asyncio.wait_for(srv.receive(), 10) == b"after the flood"
        await eventually(lambda: srv.transport.is_reading(), timeout=5, what="reading resumed")
        await srv.send(b"back")
        assert await asyncio.wait_for(client.receive(), 5) == b"back"
    finally:
        await ws.close()


async def test_a_ping_flooder_that_never_reads_is_cut_at_the_drain_deadline(server: Server,
                                                                          http: aiohttp.ClientSession) -> None:
    ws, srv, _ = await stalled_pair(server, http)
    srv.drain_timeout = 0.5
    transport_of(ws).write(ping_flood(20_000))
    try:
        with pytest.raises(TransportError, match=r"peer not reading: a pong waited 0.5s"):
            await asyncio.wait_for(srv.receive(), 5)
        await eventually(lambda: srv.transport.is_closing(), timeout=2, what="the connection cut")
    finally:
        await ws.close()


async def test_an_upgraded_connection_keeps_no_http_parser_nor_an_empty_inbox(server: Server,
                                                                             http: aiohttp.ClientSession) -> None:
    """Memory per idle session (issue 31): once upgraded, the gateway's connection lets aiohttp's HTTP parser go
    (aiohttp reads no further request there), keeps no request queue (a deque) nor aiohttp's WebSocket writer,
    and the link holds an inbox only while messages wait; messages still flow both ways and the close
    handshake still ends both sides."""
    ws = await http.ws_connect(server.url, compress=0)
    client = take_over(ws, max_message=MAX)
    srv = await asyncio.wait_for(server.links.get(), 5)
    assert srv.protocol._parser is None  # type: ignore[attr-defined]
    assert not isinstance(srv.protocol._messages, deque) and not srv.protocol._messages  # type: ignore[attr-defined]
    assert server.responses[-1]._writer is None and server.responses[-1].prepared
    await client.send_many([b"one", b"two"])
    assert [await srv.receive() for _ in range(2)] == [b"one", b"two"]
    assert srv._inbox is None
    await srv.send_many([b"back"])
    assert await client.receive() == b"back"
    await client.close()
    with pytest.raises(TransportError, match="peer closed the websocket"):
        await asyncio.wait_for(srv.receive(), 5)
    await ws.close()


async def test_an_idle_session_keeps_no_empty_queue_nor_spare_future(server: Server,
                                                                       http: aiohttp.ClientSession) -> None:
    """Memory per idle session (issue 31): after the handshake, a stream answered and heartbeats, both ends of a
    session over real links hold no empty queue (the outbox's four, the frame decoder's two, the handshake's
    greeting, the tunnel's waiting lists), no HELLO, and no future but the link's one wait for its end; a stream
    and the close still work from there."""
    ws = await http.ws_connect(server.url, compress=0)
    agent_link = take_over(ws, max_message=MAX)
    gateway_link = await asyncio.wait_for(server.links.get(), 5)
    welcome = wire.Welcome(wire.PROTOCOL_VERSION, "gw-0", 1, 0.2, 5.0, 64 * 1024, 8)
    hello = wire.Hello("agent-1", "s" * 32, (wire.PROTOCOL_VERSION,), 64 * 1024, 8)
    (gateway, _), (agent, _) = await asyncio.gather(
        accept(gateway_link, lambda _: welcome, lambda *_: None, limits=wire.DEFAULT_LIMITS, timeout=5),
        connect(agent_link, hello, limits=wire.DEFAULT_LIMITS, timeout=5))

    def answer(stream: Stream) -> None:
        stream.send_head(200, "OK", ())
        asyncio.get_running_loop().create_task(stream.write(b"page", end=True))

    agent.on_open = answer
    serving = [asyncio.create_task(gateway_link.serve(gateway)), asyncio.create_task(agent_link.serve(agent))]

    async def scrape() -> None:
        stream = gateway.open_stream(wire.Open(0, wire.StreamKind.HTTP, "edge-1", 9400, "GET", "/metrics", (), True))
        assert (await stream.head()).status == 200 and await stream.read() == b"page"
        await stream.wait_finished()

    def spare(link: WsLink, session: Tunnel) -> list[str]:
        """What the session holds that an idle one need not: by name, and any future but the link's wait."""
        out, decoder = session.core.out, link._decoder
        held = {"outbox._frames": out._frames, "outbox._last": out._last, "outbox._ready": out._ready,
                "outbox._bulk": out._bulk, "decoder._held": decoder._held, "decoder._parts": decoder._parts,
                "core._greeting": session.core._greeting, "core.hello": session.core.hello,
                "tunnel._room_waiters": session._room_waiters, "tunnel._tasks": session._tasks,
                "tunnel._closed_fut": session._closed_fut, "link._gone_waiter": link._gone_waiter}
        found = [f"{name} {value!r}" for name, value in held.items() if value is not None]
        for holder in (link, session, session.core):
            found += [f"{type(holder).__name__} holds {r!r}" for r in gc.get_referents(holder)
                      if isinstance(r, asyncio.Future) and r is not link._waiter]
        return found

    await scrape()
    rtt = gateway.core.rtt
    await eventually(lambda: gateway.core.rtt != rtt, timeout=2, what="a heartbeat answered")  # pings both ways
    await eventually(lambda: not gateway.streams and not agent.streams and gateway.core.pending_bytes == 0,
                     timeout=2, what="the stream let go")
    # Between two heartbeats (a PING may be on its way at any one moment):
    await eventually(lambda: not spare(gateway_link, gateway) and not spare(agent_link, agent), timeout=2,
                     what="both ends idle, holding nothing spare")
    await scrape()  # still serves, and closes cleanly
    await gateway.close("test over")
    await asyncio.wait_for(asyncio.gather(*serving), 5)
    await agent.wait_closed()
    assert gateway.closed and agent.closed
    await ws.close()
