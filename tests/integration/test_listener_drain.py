"""A draining listener answers a request it has received, with ``Connection: close``, instead of resetting it.

Found by issue 29 item 8: the drain closed every keep-alive connection the guard saw as idle, also one whose
next request had arrived but was not read yet. A socket closed with unread bytes sends a reset; a request
aiohttp had read while it answered the last one was lost with the connection. Go's client sends such a request
again, but a draining replica should answer what it received. The guard now closes an idle connection only when
it is quiet (raven/http/quiet.py) and the idle timer does the same.

Real sockets, plain and TLS, on both event loops; the request is made to wait in the socket (or in aiohttp)
at the instant the drain or the idle timer runs, which is what a busy gateway's loop does by chance.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from aiohttp import web

from raven.config import TLSConfig
from raven.demo.launch import free_port
from raven.http.guard import ConnectionGuard, GuardLimits
from raven.http.listener import GuardedSite, guarded_handler
from raven.http.quiet import unread_bytes
from raven.transport.tls import client_context, server_context
from tests.support.listenerbed import Loop, listener_pki, loops

pytestmark = [pytest.mark.integration]



LOOPS = pytest.mark.parametrize("factory", [f for _, f in loops()], ids=[n for n, _ in loops()])
TLS = pytest.mark.parametrize("use_tls", [False, True], ids=["plain", "tls"])


@pytest.fixture(scope="module")
def pki_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return listener_pki(tmp_path_factory.mktemp("pki"))


class Front:
    """A guarded listener whose handler answers like the gateway's front end: ``Connection: close`` while
    draining (gateway/service.py ``_front_handle``)."""

    def __init__(self, guard: ConnectionGuard, port: int, client_tls: ssl.SSLContext | None) -> None:
        self.guard = guard
        self.port = port
        self.client_tls = client_tls
        self.on_request: Callable[[str], None] = lambda path: None

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        self.on_request(request.path)
        resp = web.Response(text=f"page {request.path}\n")
        if self.guard.draining:
            resp.force_close()
        return resp

    async def connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection("127.0.0.1", self.port, ssl=self.client_tls,
                                             server_hostname="gw" if self.client_tls else None)

    def wait_unread(self) -> None:
        """Return once the server's socket holds bytes its loop has not read, without letting the loop run."""
        deadline = time.monotonic() + 2
        while not any(unread_bytes(t) for t in list(self.guard._conns)):
            assert time.monotonic() < deadline, "the request never reached the server's socket"
            time.sleep(0.001)  # the loop must not run: it would read them


@contextlib.asynccontextmanager
async def front(pki_dir: Path, use_tls: bool, limits: GuardLimits) -> AsyncIterator[Front]:
    guard = ConnectionGuard("test front", limits)
    port = free_port("127.0.0.1")
    tls = TLSConfig(cert=pki_dir / "gw.pem", key=pki_dir / "gw-key.pem", ca=pki_dir / "ca.pem")
    client = TLSConfig(cert=pki_dir / "agent-1.pem", key=pki_dir / "agent-1-key.pem", ca=pki_dir / "ca.pem")
    f = Front(guard, port, client_context(client) if use_tls else None)
    runner = web.ServerRunner(web.Server(guarded_handler(guard, f.handle)), shutdown_timeout=1)
    await runner.setup()
    await GuardedSite(runner, "127.0.0.1", port, guard, ssl_context=server_context(tls) if use_tls else None).start()
    try:
        yield f
    finally:
        await runner.cleanup()


def request(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: gw\r\n\r\n".encode()


async def response(reader: asyncio.StreamReader) -> tuple[dict[str, str], bytes]:
    """One response (a Content-Length body); raises on a reset, IncompleteReadError on a close before it."""
    async with asyncio.timeout(5):
        head = (await reader.readuntil(b"\r\n\r\n")).decode()
        status, *lines = head.split("\r\n")
        assert status.startswith("HTTP/1.1 200"), head
        fields = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines if line)}
        return fields, await reader.readexactly(int(fields["content-length"]))


async def ends_cleanly(reader: asyncio.StreamReader) -> None:
    """The server closed the connection with a FIN, nothing more to read."""
    async with asyncio.timeout(5):
        assert await reader.read() == b""


async def next_request_in_the_socket_as_the_drain_begins(pki_dir: Path, use_tls: bool) -> None:
    async with front(pki_dir, use_tls, GuardLimits()) as f:
        reader, writer = await f.connect()
        try:
            writer.write(request("/1"))
            fields, body = await response(reader)
            assert body == b"page /1\n" and fields.get("connection", "").lower() != "close"  # kept alive
            writer.write(request("/2"))  # sent at once (the transport's buffer is empty)...
            f.wait_unread()  # ...and in the server's socket, unread, as the drain begins
            assert f.guard.drain() == 0  # not closed: its request is here
            fields, body = await response(reader)  # before the fix: ConnectionResetError (or EOF: no answer)
            assert body == b"page /2\n" and fields["connection"].lower() == "close"
            await ends_cleanly(reader)
        finally:
            writer.close()


async def next_request_taken_by_aiohttp_as_the_drain_begins(pki_dir: Path, use_tls: bool) -> None:
    async with front(pki_dir, use_tls, GuardLimits()) as f:
        loop = asyncio.get_running_loop()
        drained: list[int] = []
        # The drain runs just after the answer to /1, before aiohttp takes up /2, which it read with /1.

        def on_request(path: str) -> None:
            if path == "/1":
                loop.call_soon(lambda: drained.append(f.guard.drain()))

        f.on_request = on_request
        reader, writer = await f.connect()
        try:
            writer.write(request("/1") + request("/2"))  # the second as the first's answer leaves (pipelined)
            fields, body = await response(reader)
            assert body == b"page /1\n" and fields.get("connection", "").lower() != "close"
            fields, body = await response(reader)  # before the fix: EOF, the request lost with the connection
            assert body == b"page /2\n" and fields["connection"].lower() == "close"
            await ends_cleanly(reader)
            assert drained == [0]
        finally:
            writer.close()


async def a_quiet_keep_alive_connection_is_closed_by_the_drain(pki_dir: Path, use_tls: bool) -> None:
    async with front(pki_dir, use_tls, GuardLimits()) as f:
        reader, writer = await f.connect()
        try:
            writer.write(request("/1"))
            fields, body = await response(reader)
            assert body == b"page /1\n" and fields.get("connection", "").lower() != "close"
            await asyncio.sleep(0.05)  # its handler done, aiohttp waits for the next request
            assert f.guard.drain() == 1
            await ends_cleanly(reader)
            async with asyncio.timeout(5):
                await f.guard.wait_empty()
        finally:
            writer.close()


async def from_a_read_callback(action: Callable[[], None]) -> None:
    """Run ``action`` where a loop runs a socket's read callback (its poll phase), not from its ready queue."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    class Trigger(asyncio.Protocol):
        def data_received(self, data: bytes) -> None:
            try:
                action()
            except BaseException as exc:
                done.set_exception(exc)
            else:
                done.set_result(None)

    ours, theirs = socket.socketpair()
    transport, _ = await loop.connect_accepted_socket(Trigger, ours)
    try:
        theirs.send(b"!")
        await done
    finally:
        transport.close()
        theirs.close()


async def next_request_in_the_socket_as_the_idle_timer_fires(pki_dir: Path, use_tls: bool) -> None:
    async with front(pki_dir, use_tls, GuardLimits(head_timeout=2.0, idle_timeout=0.3)) as f:
        reader, writer = await f.connect()
        try:
            writer.write(request("/1"))
            await response(reader)

            def busy_loop() -> None:  # a loop busy with other connections as the next request comes
                writer.write(request("/2"))
                f.wait_unread()
                time.sleep(0.5)  # past the idle deadline, the request unread in the socket

            await from_a_read_callback(busy_loop)
            fields, body = await response(reader)  # before the fix: ConnectionResetError
            assert body == b"page /2\n" and fields.get("connection", "").lower() != "close"  # not draining
            await ends_cleanly(reader)  # quiet now: the idle timer closes it
        finally:
            writer.close()


@LOOPS
@TLS
def test_next_request_in_the_socket_as_the_drain_begins_is_answered(pki_dir: Path, use_tls: bool,
                                                                    factory: Loop) -> None:
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(next_request_in_the_socket_as_the_drain_begins(pki_dir, use_tls))


@LOOPS
@TLS
def test_next_request_taken_by_aiohttp_as_the_drain_begins_is_answered(pki_dir: Path, use_tls: bool,
                                                                       factory: Loop) -> None:
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(next_request_taken_by_aiohttp_as_the_drain_begins(pki_dir, use_tls))


@LOOPS
@TLS
def test_a_quiet_keep_alive_connection_is_closed_by_the_drain(pki_dir: Path, use_tls: bool, factory: Loop) -> None:
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(a_quiet_keep_alive_connection_is_closed_by_the_drain(pki_dir, use_tls))


@TLS
def test_next_request_in_the_socket_as_the_idle_timer_fires_is_answered(pki_dir: Path, use_tls: bool) -> None:
    """uvloop (the services' loop) runs the timers that fell due before it reads the sockets that became
    readable meanwhile: the idle close came first. (The stock loop reads first.)"""
    uvloop = pytest.importorskip("uvloop")
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(next_request_in_the_socket_as_the_idle_timer_fires(pki_dir, use_tls))
