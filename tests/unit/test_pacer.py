"""raven/transport/pacer.py over real TCP sockets: the kernel holds at most the low mark unsent (the rest stays in
the session, issue 29 item 9), the wait ends when the peer reads, and closing lets the connection close for real."""

from __future__ import annotations

import array
import asyncio
import fcntl
import os
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from raven.transport.pacer import Pacer

pytestmark = pytest.mark.asyncio

SIOCOUTQNSD = 0x894B  # bytes in the send queue not yet sent


def unsent(sock: socket.socket) -> int:
    buf = array.array("i", [0])
    fcntl.ioctl(sock.fileno(), SIOCOUTQNSD, buf)
    return buf[0]


class Peer:
    """The far end: accepts one connection and reads only when told to."""

    def __init__(self) -> None:
        self.reading = asyncio.Event()
        self.eof = asyncio.Event()
        self.got = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self.reading.wait()
        while data := await reader.read(1 << 16):
            self.got += len(data)
        self.eof.set()
        writer.close()


@pytest_asyncio.fixture
async def link() -> AsyncIterator[tuple[Peer, asyncio.StreamWriter]]:
    peer = Peer()
    server = await asyncio.start_server(peer.handle, "127.0.0.1", 0)
    _, writer = await asyncio.open_connection(*server.sockets[0].getsockname()[:2])
    try:
        yield peer, writer
    finally:
        peer.reading.set()
        writer.close()
        server.close()
        await server.wait_closed()


async def test_the_kernel_holds_no_more_than_the_mark_and_the_wait_ends_when_the_peer_reads(
        link: tuple[Peer, asyncio.StreamWriter]) -> None:
    peer, writer = link
    sock = writer.get_extra_info("socket")
    pacer = Pacer.of(sock, asyncio.get_running_loop())
    assert pacer is not None
    written = 0
    for _ in range(10_000):  # the peer reads nothing: its window fills, then the kernel's unsent bytes grow
        room = pacer.room()
        if room <= 0:
            break
        writer.write(b"x" * min(room, 16384))
        written += min(room, 16384)
        await asyncio.sleep(0)
    else:
        pytest.fail("the kernel took everything: no low mark")
    assert unsent(sock) <= pacer.lowat + 16384  # the last write may pass the mark by itself, no more
    assert writer.transport.get_write_buffer_size() == 0  # and nothing waits in the transport either
    descriptors = len(os.listdir("/proc/self/fd"))
    waiting = asyncio.ensure_future(pacer.writable())
    await asyncio.sleep(0.2)
    assert not waiting.done()  # nothing sent: no room
    peer.reading.set()
    async with asyncio.timeout(5):
        await waiting
    assert pacer.room() > 0
    assert len(os.listdir("/proc/self/fd")) == descriptors  # the wait's duplicate descriptor is closed
    pacer.close()
    pacer.close()  # idempotent


async def test_closing_the_pacer_lets_the_connection_close(link: tuple[Peer, asyncio.StreamWriter]) -> None:
    peer, writer = link
    pacer = Pacer.of(writer.get_extra_info("socket"), asyncio.get_running_loop())
    assert pacer is not None
    while pacer.room() > 0:  # fill to the mark, so that the wait has made its duplicate descriptor
        writer.write(b"y" * 16384)
        await asyncio.sleep(0)
    waiting = asyncio.ensure_future(pacer.writable())
    await asyncio.sleep(0.05)
    pacer.close()  # as the session does before its transport's close: the waiter ends, the duplicate goes
    async with asyncio.timeout(1):
        await waiting
    writer.close()
    peer.reading.set()
    async with asyncio.timeout(5):
        await peer.eof.wait()  # a duplicate left open would keep the connection: no FIN, no EOF


async def test_not_a_tcp_socket_is_not_paced() -> None:
    loop = asyncio.get_running_loop()
    assert Pacer.of(None, loop) is None
    a, b = socket.socketpair()
    try:
        assert Pacer.of(a, loop) is None
    finally:
        a.close()
        b.close()


class CountingSocket:
    """The transport's socket, counting the pacer's questions to the kernel."""

    def __init__(self, sock: Any) -> None:
        self.sock = sock
        self.family = sock.family
        self.asked = 0

    def getsockopt(self, *args: Any) -> Any:
        self.asked += 1
        return self.sock.getsockopt(*args)

    def setsockopt(self, *args: Any) -> None:
        self.sock.setsockopt(*args)

    def fileno(self) -> int:
        return int(self.sock.fileno())


async def test_what_was_written_since_the_last_answer_spares_asking_and_never_overfills(
        link: tuple[Peer, asyncio.StreamWriter]) -> None:
    peer, writer = link
    sock = CountingSocket(writer.get_extra_info("socket"))
    pacer = Pacer.of(sock, asyncio.get_running_loop())
    assert pacer is not None
    first = pacer.room(1000)
    assert first > 1000 and sock.asked == 1
    writer.write(b"z" * 1000)
    pacer.spent(1000)
    assert pacer.room(1000) == first - 1000 and sock.asked == 1  # the floor covers it: no question
    assert pacer.room() > 0 and sock.asked == 2  # without a want, the kernel is asked
    writes = 0
    for _ in range(10_000):  # the peer reads nothing: the floor runs out, the kernel is asked, up to the mark
        room = pacer.room(3000)  # a scrape's few kilobytes at a time
        if room <= 0:
            break
        writer.write(b"z" * 3000)
        pacer.spent(3000)
        writes += 1
        await asyncio.sleep(0)
    else:
        pytest.fail("the kernel took everything: no low mark")
    assert unsent(sock.sock) <= pacer.lowat + 3000  # the floor never let more than one write past the mark
    assert sock.asked < 2 + writes  # and most writes were not preceded by a question
    peer.reading.set()
    pacer.close()
