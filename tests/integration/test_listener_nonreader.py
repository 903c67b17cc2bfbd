"""A client that reads nothing of a large answer does not keep its connection for ever (real sockets).

A close waits for what is still buffered to be sent; a client whose receive window stays zero never lets it be
sent, so a closed connection (its slot under the guard's caps, its descriptor, its handler) stayed for the life
of the process. The guard resets such a connection once the client took nothing for a whole head_timeout,
while a client that reads gets its whole answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket

import pytest
from aiohttp import web

from raven.demo.launch import free_port
from raven.http.guard import ConnectionGuard, GuardLimits
from raven.http.listener import GuardedSite, guarded_handler

pytestmark = [pytest.mark.asyncio, pytest.mark.integration]

BIG = 8 * 1024 * 1024  # far more than the kernel's buffers on both ends hold (a few MiB on loopback)
TIMEOUT = 1.0  # head and idle timeouts


async def connect(port: int, rcvbuf: int = 0) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    sock = socket.socket()
    if rcvbuf:  # a small window: the server's buffer fills sooner
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    return await asyncio.open_connection(sock=sock)


async def test_a_client_that_reads_nothing_of_a_large_answer_is_reset_one_that_reads_is_served() -> None:
    refused: list[str] = []
    guard = ConnectionGuard("test ops", GuardLimits(head_timeout=TIMEOUT, idle_timeout=TIMEOUT),
                            on_refused=refused.append)
    body = b"x" * BIG

    async def handler(request: web.BaseRequest) -> web.StreamResponse:
        # A low-level handler returns its answer before aiohttp writes it: the guard's idle timer runs while
        # the body goes out (as for the ops listener's /sd and /nodes).
        return web.Response(body=body)

    runner = web.ServerRunner(web.Server(guarded_handler(guard, handler)))
    await runner.setup()
    port = free_port("127.0.0.1")
    await GuardedSite(runner, "127.0.0.1", port, guard).start()
    writers: list[asyncio.StreamWriter] = []
    try:
        _, stalled = await connect(port, rcvbuf=4096)
        writers.append(stalled)
        stalled.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        reader, other = await connect(port)
        writers.append(other)
        other.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        await other.drain()
        # Another client of the same address, which reads, takes its whole answer meanwhile.
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert head.startswith(b"HTTP/1.1 200")
        got = 0
        while got < BIG:
            part = await asyncio.wait_for(reader.read(1024 * 1024), 10)
            assert part, f"the reader's connection ended after {got} of {BIG} bytes"
            got += len(part)
        assert got == BIG
        # The one that read nothing was reset (and only that one); the reader's connection, idle now, is closed
        # at its idle timeout: none is left.
        for _ in range(200):
            if guard.connections == 0:
                break
            await asyncio.sleep(0.05)
        assert guard.connections == 0, f"{guard.connections} connection(s) kept"
        assert refused == ["write-stall"]
    finally:
        for w in writers:
            w.close()
        for w in writers:
            with contextlib.suppress(OSError):
                await w.wait_closed()
        await runner.cleanup()
