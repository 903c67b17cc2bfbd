"""The tests' Service stand-ins pass a reset on, as kube-proxy's NAT does (real sockets).

Found by issue 29 item 8: the copy loop (tests/support/tcplb.py ``pipe``) ended on a backend's reset without
closing or resetting the client's side, so the client waited for its own timeout (3 of 231,484 scrapes of the
rolling-restart test, on reused connections, exactly at a SIGTERM). A NAT passes every segment on: a reset
reaches the other peer as a reset, a FIN as a FIN (a half close, which stays one).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from raven.aio import reset_connection
from raven.demo.launch import free_port
from tests.support.servicelb import ServiceBalancer
from tests.support.tcplb import TcpBalancer

pytestmark = [pytest.mark.asyncio, pytest.mark.integration]

PROMPT = 2.0  # seconds: a reset is passed on at once; a client left waiting would wait for its own timeout
SERVICE, BACKEND = "127.0.0.1", "127.0.33.2"

Backend = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@contextlib.asynccontextmanager
async def balanced(kind: str, backend: Backend, ready: bool = True) -> AsyncIterator[int]:
    """A backend behind a balancer of ``kind``; yields the port to connect to (on SERVICE)."""
    port = free_port(BACKEND)
    server = await asyncio.start_server(backend, BACKEND, port)
    lb: TcpBalancer | ServiceBalancer
    if kind == "tcplb":
        listen = free_port(SERVICE)
        lb = TcpBalancer((SERVICE, listen), [(BACKEND, port)])
    else:  # a Service listens on the backends' port
        listen = port
        lb = ServiceBalancer(SERVICE, [port], [BACKEND], probe_port=0, period=1)
        lb.ready[BACKEND] = ready  # no prober in these tests
    await lb.start()
    try:
        yield listen
    finally:
        await lb.close()
        server.close()
        await server.wait_closed()


KINDS = pytest.mark.parametrize("kind", ["tcplb", "servicelb"])


@KINDS
async def test_a_backends_reset_reaches_the_client_at_once(kind: str) -> None:
    async def resets(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readexactly(4)
        writer.write(b"half")  # part of an answer, then the reset (a replica killed mid-answer)
        await writer.drain()
        reset_connection(writer.transport)

    async with balanced(kind, resets) as port:
        reader, writer = await asyncio.open_connection(SERVICE, port)
        try:
            writer.write(b"ping")
            async with asyncio.timeout(PROMPT):  # before the fix: no end at all, the client waits
                with pytest.raises(ConnectionResetError):
                    while await reader.read(65536):
                        pass
        finally:
            writer.close()


@KINDS
async def test_a_clients_reset_reaches_the_backend_at_once(kind: str) -> None:
    seen: asyncio.Future[BaseException | bytes] = asyncio.get_running_loop().create_future()

    async def waits(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            data = await reader.readexactly(4)
            writer.write(b"pong")
            await writer.drain()
            data += await reader.read()
            seen.set_result(data)
        except OSError as exc:
            seen.set_result(exc)
        finally:
            writer.close()

    async with balanced(kind, waits) as port:
        reader, writer = await asyncio.open_connection(SERVICE, port)
        writer.write(b"ping")
        assert await asyncio.wait_for(reader.readexactly(4), PROMPT) == b"pong"
        reset_connection(writer.transport)
        assert isinstance(await asyncio.wait_for(seen, PROMPT), ConnectionResetError)


@KINDS
async def test_a_half_close_stays_a_half_close(kind: str) -> None:
    rest: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

    async def answers_then_reads(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"hello")
        writer.write_eof()  # the backend is done sending; it still reads
        rest.set_result(await reader.read())
        writer.close()

    async with balanced(kind, answers_then_reads) as port:
        reader, writer = await asyncio.open_connection(SERVICE, port)
        try:
            async with asyncio.timeout(PROMPT):
                assert await reader.read() == b"hello"  # the FIN came through as a FIN
                writer.write(b"still here")  # and the other direction is still open
                writer.write_eof()
                assert await rest == b"still here"
        finally:
            writer.close()


async def test_a_service_with_no_ready_endpoint_resets_the_client() -> None:
    async def unused(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.close()

    async with balanced("servicelb", unused, ready=False) as port:
        reader, writer = await asyncio.open_connection(SERVICE, port)
        try:
            with pytest.raises(ConnectionResetError):  # kube-proxy rejects; before: an empty, clean close
                await asyncio.wait_for(reader.read(), PROMPT)
        finally:
            writer.close()
