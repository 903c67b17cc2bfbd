"""A handler that took its connection over (the front end's CONNECT relay) waits for a client that reads slowly
and learns of one that left (raven/http/guard.py's ``drained``, over aiohttp's flow control; real sockets)."""

from __future__ import annotations

import asyncio
import socket

import pytest
from aiohttp import web

from raven.demo.launch import free_port
from raven.http.guard import ConnectionGuard, GuardLimits
from raven.http.listener import GuardedSite, guarded_handler

pytestmark = [pytest.mark.asyncio, pytest.mark.integration]

CHUNK = 256 * 1024
TOTAL = 64 * CHUNK  # 16 MiB: far more than both ends' kernel buffers hold


async def serve(guard: ConnectionGuard, outcome: asyncio.Future[tuple[int, int, str]]) -> int:
    async def handler(request: web.BaseRequest) -> web.StreamResponse:
        transport = request.transport
        assert transport is not None
        sent = most = 0
        why = "done"
        try:
            while sent < TOTAL:
                transport.write(b"x" * CHUNK)
                sent += CHUNK
                most = max(most, transport.get_write_buffer_size())
                await guard.drained(request)
        except ConnectionResetError as exc:
            why = str(exc)
        outcome.set_result((sent, most, why))
        transport.close()
        return web.Response()

    runner = web.ServerRunner(web.Server(guarded_handler(guard, handler)))
    await runner.setup()
    port = free_port("127.0.0.1")
    await GuardedSite(runner, "127.0.0.1", port, guard).start()
    return port


async def connect(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 * 1024)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    reader, writer = await asyncio.open_connection(sock=sock)
    writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    await writer.drain()
    return reader, writer


async def test_a_taken_over_connection_waits_for_a_slow_reader_and_delivers_everything() -> None:
    guard = ConnectionGuard("test", GuardLimits(head_timeout=30.0, idle_timeout=30.0))
    outcome: asyncio.Future[tuple[int, int, str]] = asyncio.get_running_loop().create_future()
    reader, writer = await connect(await serve(guard, outcome))
    try:
        await asyncio.sleep(0.5)  # the client reads nothing yet: the handler must be waiting, not buffering
        assert not outcome.done()
        got = 0
        while part := await asyncio.wait_for(reader.read(1024 * 1024), 10):
            got += len(part)
        sent, most, why = await asyncio.wait_for(outcome, 10)
        assert (sent, why, got) == (TOTAL, "done", TOTAL)
        assert most <= 4 * CHUNK, f"{most} bytes buffered in the process: the writer did not wait"
    finally:
        writer.close()


async def test_a_taken_over_connection_learns_that_its_client_left() -> None:
    guard = ConnectionGuard("test", GuardLimits(head_timeout=30.0, idle_timeout=30.0))
    outcome: asyncio.Future[tuple[int, int, str]] = asyncio.get_running_loop().create_future()
    _, writer = await connect(await serve(guard, outcome))
    await asyncio.sleep(0.5)
    assert not outcome.done()  # waiting for the client to read
    writer.transport.abort()  # the client goes away (a reset)
    sent, _, why = await asyncio.wait_for(outcome, 10)
    assert sent < TOTAL and why == "client connection lost"
