"""The lean front-end server (raven/http/h1server.py) on real sockets, behind the connection guard.

Each deadline of a request runs on the connection's one timer and cuts at its own time: a head that does not
come, a body that stalls, a keep-alive connection left idle. Pipelined requests are answered in their order; a
client that stops reading holds at most the transport's high-water mark of its answer and is then reset, its
connection, task and buffers gone. And a keep-alive connection costs about one timer handle per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
import pytest_asyncio

from raven.demo.launch import free_port
from raven.http.guard import ConnectionGuard, GuardLimits
from raven.http.h1server import LeanCall, LeanServer
from raven.http.listener import GuardedSite, LeanRunner

pytestmark = [pytest.mark.asyncio, pytest.mark.integration]

HEAD, IDLE, BODY, STALL = 0.5, 1.0, 0.7, 0.6
BIG = 16 * 1024 * 1024
CHUNK = 64 * 1024


@dataclass
class Lean:
    port: int
    guard: ConnectionGuard
    server: LeanServer
    refused: list[str]
    malformed: list[str]
    outcomes: list[str] = field(default_factory=list)
    most_buffered: int = 0
    writes: list[int] = field(default_factory=list)  # transport writes per answer of /page

    async def connect(self, rcvbuf: int = 0) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        sock = socket.socket()
        if rcvbuf:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", self.port))
        return await asyncio.open_connection(sock=sock)


@pytest_asyncio.fixture
async def lean() -> AsyncIterator[Lean]:
    refused: list[str] = []
    malformed: list[str] = []
    guard = ConnectionGuard("lean test", GuardLimits(head_timeout=HEAD, idle_timeout=IDLE), on_refused=refused.append)
    state: Lean

    async def handler(call: LeanCall) -> None:
        assert guard.vouch(call) is None  # as the front end does for a request with credentials
        path = call.raw_path
        if path == "/echo":  # the body, within BODY seconds
            try:
                got = b""
                async with call.timeout(time.monotonic() + BODY):
                    while chunk := await call.read():
                        got += chunk
            except TimeoutError:
                call.respond(408, (), b"slow body after %d bytes\n" % len(got), True)
                return
            call.respond(200, (), got, False)
        elif path == "/big":  # far more than the socket buffers hold, in 64 KiB writes
            transport = call.transport
            assert transport is not None
            try:
                await call.send(200, "", (), BIG, b"x" * CHUNK, False, time.monotonic() + STALL)
                for _ in range(BIG // CHUNK - 1):
                    await call.write(b"x" * CHUNK, time.monotonic() + STALL)
                    state.most_buffered = max(state.most_buffered, transport.get_write_buffer_size())
                await call.end(time.monotonic() + STALL)
                state.outcomes.append("done")
            except TimeoutError:
                state.most_buffered = max(state.most_buffered, transport.get_write_buffer_size())
                state.outcomes.append("stalled")
                call.abort()
        elif path == "/page":  # as the proxy answers a page that came whole (HEAD, DATA, FIN in one message)
            transport = call.transport
            assert transport is not None
            counted = [0]
            write = transport.write

            def counting(data: bytes | bytearray | memoryview) -> None:
                counted[0] += 1
                write(data)

            transport.write = counting  # type: ignore[method-assign]
            try:
                await call.send(200, "", (("Content-Type", "text/plain"),), None, b"p" * 50_000, False,
                                time.monotonic() + STALL)
                await call.end(time.monotonic() + STALL)
            finally:
                del transport.write
            state.writes.append(counted[0])
        elif path.startswith("/slow/"):
            await asyncio.sleep(float(path.rsplit("/", 1)[1]))
            call.respond(200, (), path.encode(), False)
        else:
            call.respond(200, (), path.encode(), False)

    server = LeanServer(handler, guard, 1024, 8192, lambda client, why: malformed.append(why))
    runner = LeanRunner(server, shutdown_timeout=1.0)
    await runner.setup()
    port = free_port("127.0.0.1")
    await GuardedSite(runner, "127.0.0.1", port, guard).start()
    state = Lean(port, guard, server, refused, malformed)
    try:
        yield state
    finally:
        await runner.cleanup()


async def read_answer(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    length = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
    return head, await asyncio.wait_for(reader.readexactly(length), 5)


async def gone(lean: Lean) -> None:
    for _ in range(100):
        if not lean.guard.connections and not lean.server.connections and not lean.server.tasks:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{lean.guard.connections} connection(s), {len(lean.server.tasks)} task(s) left")


async def test_each_deadline_cuts_at_its_own_time(lean: Lean) -> None:
    # A head that never ends: 408 at the head deadline.
    reader, writer = await lean.connect()
    start = time.monotonic()
    writer.write(b"GET /a HTTP/1.1\r\nHost: x\r\n")
    answer = await asyncio.wait_for(reader.read(), 5)
    assert answer.startswith(b"HTTP/1.1 408") and HEAD * 0.9 <= time.monotonic() - start < HEAD + 1.5, answer
    writer.close()
    # A body that stops: the handler's body deadline, on the same timer, not the head's nor the idle one.
    reader, writer = await lean.connect()
    start = time.monotonic()
    writer.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nabc")
    head, body = await read_answer(reader)
    assert head.startswith(b"HTTP/1.1 408") and body == b"slow body after 3 bytes\n"
    assert BODY * 0.9 <= time.monotonic() - start < BODY + 1.5
    writer.close()
    # A keep-alive connection left idle after its answer: closed at the idle deadline, not before.
    reader, writer = await lean.connect()
    writer.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello")
    head, body = await read_answer(reader)
    assert head.startswith(b"HTTP/1.1 200") and body == b"hello" and b"Connection: close" not in head
    start = time.monotonic()
    assert await asyncio.wait_for(reader.read(), 5) == b""
    assert IDLE * 0.9 <= time.monotonic() - start < IDLE + 1.5
    writer.close()
    assert lean.refused == ["head-timeout"]
    await gone(lean)


async def test_pipelined_requests_are_answered_in_order(lean: Lean) -> None:
    reader, writer = await lean.connect()
    # The first takes longest: its answer still comes first.
    writer.write(b"GET /slow/0.3 HTTP/1.1\r\nHost: x\r\n\r\nPOST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
                 b"\r\nokGET /slow/0 HTTP/1.1\r\nHost: x\r\n\r\n"
                 b"GET /last HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    bodies = [(await read_answer(reader))[1] for _ in range(4)]
    assert bodies == [b"/slow/0.3", b"ok", b"/slow/0", b"/last"]
    assert await asyncio.wait_for(reader.read(), 5) == b""  # closed after the one that asked
    writer.close()
    await gone(lean)


async def test_a_client_that_stops_reading_is_reset_holding_a_bounded_buffer(lean: Lean) -> None:
    _, stalled = await lean.connect(rcvbuf=4096)
    stalled.write(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n")
    reader, writer = await lean.connect()  # another client reads its whole answer meanwhile
    writer.write(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n")
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    assert head.startswith(b"HTTP/1.1 200") and b"Content-Length: %d" % BIG in head
    got = 0
    while got < BIG:
        part = await asyncio.wait_for(reader.read(1 << 20), 10)
        assert part, f"ended after {got} bytes"
        got += len(part)
    writer.close()
    for _ in range(100):  # the one that reads nothing stays connected: it is reset at its write's deadline
        if len(lean.outcomes) == 2:
            break
        await asyncio.sleep(0.05)
    stalled.close()
    assert sorted(lean.outcomes) == ["done", "stalled"]
    # Flow control: the gateway never held more than the transport's high-water mark and one write.
    assert lean.most_buffered <= 64 * 1024 + CHUNK, lean.most_buffered
    await gone(lean)


async def test_a_malformed_request_is_400_with_its_reason_then_closed(lean: Lean) -> None:
    reader, writer = await lean.connect()
    writer.write(b"GET /ok HTTP/1.1\r\nHost: x\r\n\r\nPOST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n"
                 b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n")
    head, body = await read_answer(reader)
    assert head.startswith(b"HTTP/1.1 200") and body == b"/ok"  # what came before is answered
    rest = await asyncio.wait_for(reader.read(), 5)
    assert rest.startswith(b"HTTP/1.1 400") and b"Content-Length" in rest and b"Connection: close" in rest, rest
    assert len(lean.malformed) == 1 and "Content-Length" in lean.malformed[0]
    writer.close()
    await gone(lean)


async def test_a_keepalive_connection_costs_about_one_timer_handle_per_request(lean: Lean) -> None:
    loop = asyncio.get_running_loop()
    reader, writer = await lean.connect()
    created = 0
    original = loop.call_at

    def counting(when: float, callback: object, *args: object, **kwargs: object) -> asyncio.TimerHandle:
        nonlocal created
        created += 1
        return original(when, callback, *args, **kwargs)  # type: ignore[arg-type]

    requests = 20
    loop.call_at = counting  # type: ignore[method-assign]
    try:
        for i in range(requests):
            writer.write(b"GET /n/%d HTTP/1.1\r\nHost: x\r\n\r\n" % i)
            head = await reader.readuntil(b"\r\n\r\n")  # no wait_for here: it would add timers of its own
            await reader.readexactly(int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0]))
    finally:
        with contextlib.suppress(AttributeError):
            del loop.call_at
    # Head, answer and idle deadlines of every request on the connection's one timer: at most about one new
    # handle per request (aiohttp's server with the guard made five or more).
    assert created <= requests + 2, created
    writer.close()
    await gone(lean)


async def test_a_page_that_is_all_there_leaves_in_one_write(lean: Lean) -> None:
    reader, writer = await lean.connect()
    writer.write(b"GET /page HTTP/1.1\r\nHost: x\r\n\r\n")
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert head.startswith(b"HTTP/1.1 200") and b"Transfer-Encoding: chunked" in head
    body = await asyncio.wait_for(reader.readuntil(b"\r\n0\r\n\r\n"), 5)
    assert body == b"c350\r\n" + b"p" * 50_000 + b"\r\n0\r\n\r\n"
    # The head with the first chunk, then the last chunk: two writes for a page of unknown length (one with a
    # Content-Length, the usual case, which the other tests' answers take).
    assert lean.writes == [2]
    writer.close()
    await gone(lean)


async def test_a_pipelined_flood_that_reads_nothing_is_held_and_then_reset(lean: Lean) -> None:
    # Found by review: each answered request resumed reading (one more read per answer), and the next pipelined
    # request was served while the client read none of the answers: both queues grew without bound.
    _, writer = await lean.connect(rcvbuf=4096)
    request = b"GET /" + b"p" * 900 + b" HTTP/1.1\r\nHost: x\r\n\r\n"  # each answer echoes its 906-byte path
    most_ready = most_written = 0
    loop = asyncio.get_running_loop()
    end = loop.time() + 3.0
    while loop.time() < end and not writer.is_closing():
        writer.write(request * 64)
        with contextlib.suppress(TimeoutError, ConnectionError):
            await asyncio.wait_for(writer.drain(), 0.01)
        for proto in list(lean.server.connections):
            most_ready = max(most_ready, len(proto._reader.ready))
            transport = proto._transport
            if transport is not None:
                most_written = max(most_written, transport.get_write_buffer_size())
        if not lean.server.connections:
            break
    writer.transport.abort()
    # Requests held: the reading pause (256 KiB, each queued head counted 1 KiB) and one read past it.
    assert most_ready <= 256 + 300, most_ready
    # Answers held: the transport's high-water mark and one answer.
    assert most_written <= 64 * 1024 + 2048, most_written
    await gone(lean)
