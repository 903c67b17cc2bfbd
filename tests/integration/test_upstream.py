"""The agent's HTTP/1.1 client (agent/upstream.py) against hand-written servers on loopback.

Each server below answers with exact bytes (chunked, Content-Length, until close, broken mid-body, heads over
the limits, 101, interim responses, slow heads) and counts the connections it accepts, so that the tests can
tell a reused connection from a new one. Every test checks that no socket is left open in this process
afterwards (/proc/self/fd).
"""

from __future__ import annotations

import asyncio
import errno
import gzip
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import pytest
import uvloop

from agent.upstream import (
    MAX_HEADERS,
    ConnectFailed,
    PoolFull,
    RequestFailed,
    Response,
    ResponseBroken,
    UpstreamPool,
)
from tests.support.polling import eventually

pytestmark = [pytest.mark.integration]

HOST = "127.0.0.1"

Handler = Callable[["Server", asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


class Server:
    """A loopback server whose connections run ``handler``; it counts and tracks them."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.accepted = 0
        self.open = 0
        self.heads: list[bytes] = []
        self.server: asyncio.Server | None = None
        self.port = 0

    async def start(self) -> Server:
        self.server = await asyncio.start_server(self._conn, HOST, 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def _conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        self.open += 1
        try:
            await self.handler(self, reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        finally:
            self.open -= 1
            writer.close()
            try:
                await writer.wait_closed()
            except ConnectionError:
                pass

    async def read_head(self, reader: asyncio.StreamReader) -> bytes:
        head = await reader.readuntil(b"\r\n\r\n")
        self.heads.append(head)
        return head

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


def answering(*answers: bytes, keep: bool = True) -> Handler:
    """A handler that answers each request on a connection with the next of ``answers`` (the last repeats)."""

    async def handler(server: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        i = 0
        while True:
            await server.read_head(reader)
            writer.write(answers[min(i, len(answers) - 1)])
            await writer.drain()
            i += 1
            if not keep:
                return

    return handler


async def body_of(resp: Response) -> bytes:
    out = bytearray()
    while True:
        chunk, last = await resp.read()
        out += chunk
        if last:
            return bytes(out)


async def get(pool: UpstreamPool, server: Server, method: str = "GET", target: str = "/metrics",
              headers: tuple[tuple[str, str], ...] = (), body: AsyncIterator[bytes] | None = None
              ) -> tuple[int, bytes]:
    resp = await pool.request(HOST, server.port, method, target, headers, body)
    try:
        return resp.status, await body_of(resp)
    finally:
        resp.release()


@pytest.fixture
def no_leaks() -> Iterator[None]:
    before = open_fds()
    yield
    assert open_fds() <= before, f"{open_fds() - before} file descriptor(s) left open"


@pytest.fixture
async def pool(no_leaks: None) -> AsyncIterator[UpstreamPool]:
    p = UpstreamPool(connect_timeout=2.0, max_idle=4)
    yield p
    await p.close()
    assert p.open_connections == 0


async def serve(handler: Handler) -> Server:
    return await Server(handler).start()


OK2 = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


async def test_content_length_body_and_reuse(pool: UpstreamPool) -> None:
    page = os.urandom(300_000)  # more than the read buffer's high-water mark: reading pauses and resumes
    server = await serve(answering(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nX-A: 1\r\n\r\n" % len(page) + page))
    try:
        for _ in range(3):
            assert await get(pool, server) == (200, page)
        assert server.accepted == 1
        assert pool.idle_connections(HOST, server.port) == 1
        head = server.heads[0]
        assert head.startswith(b"GET /metrics HTTP/1.1\r\n")
        assert f"Host: {HOST}:{server.port}\r\n".encode() in head
        assert b"content-length" not in head.lower() and b"transfer-encoding" not in head.lower()
    finally:
        await server.close()


async def test_chunked_body_is_dechunked_and_the_connection_reused(pool: UpstreamPool) -> None:
    answer = (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nConnection: keep-alive\r\n\r\n"
              b"5\r\nhello\r\n1;ext=1\r\n,\r\n6\r\n world\r\n0\r\nX-Trailer: t\r\n\r\n")
    server = await serve(answering(answer))
    try:
        resp = await pool.request(HOST, server.port, "GET", "/", ())
        names = [name.lower() for name, _ in resp.headers]
        assert b"transfer-encoding" in names  # the forwarder drops hop-by-hop headers, the client keeps them all
        assert await body_of(resp) == b"hello, world"
        resp.release()
        assert await get(pool, server) == (200, b"hello, world")
        assert server.accepted == 1
    finally:
        await server.close()


async def test_gzip_passes_unchanged(pool: UpstreamPool) -> None:
    packed = gzip.compress(b"metric 1\n" * 1000)
    server = await serve(answering(b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: %d\r\n\r\n"
                                   % len(packed) + packed))
    try:
        assert await get(pool, server, headers=(("Accept-Encoding", "gzip"),)) == (200, packed)
        assert b"Accept-Encoding: gzip\r\n" in server.heads[0]
    finally:
        await server.close()


async def test_body_until_close_is_complete_and_not_pooled(pool: UpstreamPool) -> None:
    server = await serve(answering(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\n" + b"x" * 100_000,
                                   keep=False))
    try:
        for _ in range(2):
            assert await get(pool, server) == (200, b"x" * 100_000)
        assert server.accepted == 2
        assert pool.idle_connections(HOST, server.port) == 0
    finally:
        await server.close()


@pytest.mark.parametrize("answer", [
    b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok",
    b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok",
    b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 2\r\n\r\nok",
])
async def test_no_reuse_without_http11_keep_alive(pool: UpstreamPool, answer: bytes) -> None:
    server = await serve(answering(answer))
    try:
        for _ in range(2):
            assert await get(pool, server) == (200, b"ok")
        assert server.accepted == 2
    finally:
        await server.close()


@pytest.mark.parametrize("answer", [
    b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n" + b"x" * 10,
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\nzz\r\n",
])
async def test_a_body_that_breaks_midway(pool: UpstreamPool, answer: bytes) -> None:
    server = await serve(answering(answer, keep=False))
    try:
        resp = await pool.request(HOST, server.port, "GET", "/", ())
        assert resp.status == 200
        got = b""
        with pytest.raises(ResponseBroken):
            while True:
                chunk, last = await resp.read()
                got += chunk
                assert not last
        assert got in (b"x" * 10, b"hello")
        resp.release()
        assert pool.open_connections == 0
    finally:
        await server.close()


@pytest.mark.parametrize(("answer", "why"), [
    (b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n", "longer than 8190"),
    (b"HTTP/1.1 200 OK\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(MAX_HEADERS + 1)) + b"\r\n",
     f"more than {MAX_HEADERS} headers"),
    (b"HTTP/1.1 200 " + b"O" * 9000 + b"\r\n\r\n", "status line"),
    (b"HTTP/1.1 200 OK\r\n" + b"X-Pad: " + b"p" * 8000 + b"\r\n" + b"X-Endless: " + b"e" * 400_000, "head is longer"),
    (b"HTTP/1.1 42 X\r\n\r\n", "malformed response head"),
    (b"SSH-2.0-OpenSSH_9.6\r\n", "malformed response head"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n", "malformed response head"),
    (b"", "closed the connection before answering"),
])
async def test_bad_heads_are_refused(pool: UpstreamPool, answer: bytes, why: str) -> None:
    server = await serve(answering(answer, keep=False))
    try:
        with pytest.raises(RequestFailed, match=why):
            await pool.request(HOST, server.port, "GET", "/", ())
        assert pool.open_connections == 0
    finally:
        await server.close()


@pytest.mark.parametrize("odd", [
    b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: upgrade\r\n\r\n",
    b"HTTP/1.1 999 Weird\r\nContent-Length: 0\r\n\r\n",
])
async def test_odd_status_connection_is_closed_never_reused(pool: UpstreamPool, odd: bytes) -> None:
    async def odd_first(server: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        first = server.accepted == 1
        await server.read_head(reader)
        writer.write(odd if first else OK2)
        while True:  # the odd connection stays open: a client that reuses it gets "reused"
            await server.read_head(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\nreused" if first else OK2)

    server = await serve(odd_first)
    try:
        resp = await pool.request(HOST, server.port, "GET", "/", ())
        assert resp.status in (101, 999)
        resp.release()
        assert pool.open_connections == 0
        for _ in range(2):
            assert await get(pool, server) == (200, b"ok")
        assert server.accepted == 2
        await eventually(lambda: server.open == 1, timeout=2, interval=0.01, what="the odd connection closed")
    finally:
        await server.close()


async def test_interim_responses_are_skipped(pool: UpstreamPool) -> None:
    answer = (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n"
              b"HTTP/1.1 102 Processing\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\nX-Final: 1\r\n\r\nok")
    server = await serve(answering(answer))
    try:
        resp = await pool.request(HOST, server.port, "GET", "/", ())
        assert (resp.status, resp.reason) == (200, "OK")
        assert resp.headers == [(b"Content-Length", b"2"), (b"X-Final", b"1")]
        assert await body_of(resp) == b"ok"
        resp.release()
        assert await get(pool, server) == (200, b"ok")
        assert server.accepted == 1
    finally:
        await server.close()


async def test_endless_interim_responses_are_refused(pool: UpstreamPool) -> None:
    server = await serve(answering(b"HTTP/1.1 100 Continue\r\n\r\n" * 50))
    try:
        with pytest.raises(RequestFailed, match="interim"):
            await pool.request(HOST, server.port, "GET", "/", ())
    finally:
        await server.close()


async def test_a_pooled_connection_closed_by_the_server_is_not_used(pool: UpstreamPool) -> None:
    async def once(server: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.read_head(reader)
        writer.write(OK2)  # keep-alive semantics, then the server closes anyway (its idle timeout, say)
        await writer.drain()

    server = await serve(once)
    try:
        assert await get(pool, server) == (200, b"ok")
        await eventually(lambda: pool.idle_connections(HOST, server.port) == 0, timeout=2, interval=0.01,
                         what="the closed connection leaves the pool")
        assert await get(pool, server) == (200, b"ok")
        assert server.accepted == 2
    finally:
        await server.close()


async def test_a_reused_connection_that_dies_before_answering_is_retried_once(pool: UpstreamPool) -> None:
    async def dies_on_second(server: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.read_head(reader)
        writer.write(OK2)
        await writer.drain()
        await server.read_head(reader)  # the close raced with the client's next request: no answer

    server = await serve(dies_on_second)
    try:
        assert await get(pool, server) == (200, b"ok")
        assert await get(pool, server) == (200, b"ok")  # retried on a fresh connection
        assert server.accepted == 2
        # Not for a request that is not idempotent: it may have had an effect.
        with pytest.raises(RequestFailed, match="closed the connection before answering"):
            await get(pool, server, method="POST")
        assert server.accepted == 2
    finally:
        await server.close()


async def test_a_fresh_connection_is_not_retried(pool: UpstreamPool) -> None:
    async def silent(server: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.read_head(reader)

    server = await serve(silent)
    try:
        with pytest.raises(RequestFailed):
            await get(pool, server)
        assert server.accepted == 1
    finally:
        await server.close()


async def test_slowloris_head_is_bounded_by_the_callers_deadline(pool: UpstreamPool) -> None:
    async def slow(server: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.read_head(reader)
        for byte in b"HTTP/1.1 200 OK\r\nX-Slow: " + b"s" * 1000:
            writer.write(bytes([byte]))
            await writer.drain()
            await asyncio.sleep(0.02)

    server = await serve(slow)
    try:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.3):
                await pool.request(HOST, server.port, "GET", "/", ())
        assert pool.open_connections == 0
        await eventually(lambda: server.open == 0, timeout=2, interval=0.01, what="the server sees the close")
    finally:
        await server.close()


async def test_cancelling_mid_body_closes_the_connection(pool: UpstreamPool) -> None:
    async def stalls(server: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.read_head(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\nabc")
        await writer.drain()
        await reader.read()  # until the client closes

    server = await serve(stalls)
    try:
        resp = await pool.request(HOST, server.port, "GET", "/", ())
        assert await resp.read() == (b"abc", False)
        task = asyncio.ensure_future(resp.read())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        resp.release()
        await eventually(lambda: server.open == 0, timeout=1, interval=0.005, what="the server sees the close")
        assert pool.open_connections == 0
    finally:
        await server.close()


async def test_head_requests_have_no_body(pool: UpstreamPool) -> None:
    server = await serve(answering(b"HTTP/1.1 200 OK\r\nContent-Length: 1234\r\n\r\n"))
    try:
        assert await get(pool, server, method="HEAD") == (200, b"")
        assert server.heads[0].startswith(b"HEAD /metrics HTTP/1.1\r\n")
    finally:
        await server.close()


async def test_no_content_responses(pool: UpstreamPool) -> None:
    server = await serve(answering(b"HTTP/1.1 204 No Content\r\n\r\n", b"HTTP/1.1 304 Not Modified\r\n\r\n"))
    try:
        assert await get(pool, server) == (204, b"")
        assert await get(pool, server) == (304, b"")
        assert server.accepted == 1
    finally:
        await server.close()


async def test_stray_bytes_after_a_response_forbid_reuse(pool: UpstreamPool) -> None:
    server = await serve(answering(OK2 + b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nextra"))
    try:
        for _ in range(2):
            assert await get(pool, server) == (200, b"ok")
        assert server.accepted == 2
    finally:
        await server.close()


async def test_request_body_is_streamed_chunked(pool: UpstreamPool) -> None:
    async def echo(server: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await server.read_head(reader)
            body = b""
            while True:
                size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
                chunk = await reader.readexactly(size + 2)
                if size == 0:
                    break
                body += chunk[:-2]
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
            await writer.drain()

    async def parts() -> AsyncIterator[bytes]:
        for part in (b"one,", b"", b"two," * 50_000, b"three"):
            await asyncio.sleep(0)
            yield part

    server = await serve(echo)
    try:
        status, body = await get(pool, server, method="POST", body=parts())
        assert (status, body) == (200, b"one," + b"two," * 50_000 + b"three")
        assert b"Transfer-Encoding: chunked\r\n" in server.heads[0]
        assert await get(pool, server, method="PUT", body=parts()) == (200, body)
        assert server.accepted == 1
    finally:
        await server.close()


async def test_a_failing_request_body_closes_the_connection(pool: UpstreamPool) -> None:
    async def sink(server: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.read_head(reader)
        await reader.read()

    async def broken() -> AsyncIterator[bytes]:
        yield b"part"
        raise ConnectionResetError("the stream broke")

    server = await serve(sink)
    try:
        with pytest.raises(RequestFailed, match="sending the request body failed"):
            await get(pool, server, method="POST", body=broken())
        await eventually(lambda: server.open == 0, timeout=1, interval=0.005, what="the server sees the close")
    finally:
        await server.close()


async def test_request_head(pool: UpstreamPool) -> None:
    server = await serve(answering(OK2))
    try:
        await get(pool, server, method="POST", headers=(("host", "edge-1:9400"), ("X-Token", "t")))
        await get(pool, server, method="DELETE")
        post, delete = server.heads
        assert post == (b"POST /metrics HTTP/1.1\r\nhost: edge-1:9400\r\nX-Token: t\r\nContent-Length: 0\r\n\r\n")
        assert delete == f"DELETE /metrics HTTP/1.1\r\nHost: {HOST}:{server.port}\r\nContent-Length: 0\r\n\r\n".encode()
        with pytest.raises(ValueError, match="control character"):
            await get(pool, server, headers=(("X-Bad", "a\x01b"),))
    finally:
        await server.close()


async def test_idle_connections_time_out_and_are_bounded(no_leaks: None) -> None:
    pool = UpstreamPool(connect_timeout=2.0, max_idle=2, idle_timeout=0.2)
    server = await serve(answering(OK2))
    try:
        responses = [await pool.request(HOST, server.port, "GET", "/", ()) for _ in range(3)]
        assert server.accepted == 3
        for resp in responses:
            assert await body_of(resp) == b"ok"
            resp.release()
        assert pool.idle_connections(HOST, server.port) == 2
        assert pool.open_connections == 2
        await eventually(lambda: pool.open_connections == 0, timeout=2, interval=0.02, what="idle timeout")
        await eventually(lambda: server.open == 0, timeout=2, interval=0.01, what="the server sees the closes")
    finally:
        await pool.close()
        await server.close()


async def test_idle_connections_close_after_the_configured_time_only(no_leaks: None) -> None:
    short = UpstreamPool(connect_timeout=2.0, max_idle=2, idle_timeout=0.3)
    long = UpstreamPool(connect_timeout=2.0, max_idle=2, idle_timeout=60.0)
    server = await serve(answering(OK2))
    try:
        assert await get(short, server) == (200, b"ok")
        assert await get(long, server) == (200, b"ok")
        assert short.open_connections == long.open_connections == 1
        await eventually(lambda: short.open_connections == 0, timeout=5, interval=0.02, what="the short idle time")
        assert long.open_connections == 1 and long.idle_total == 1  # its 60 s are far from over
        assert await get(long, server) == (200, b"ok")
        assert server.accepted == 2  # the long pool reused its connection
    finally:
        await short.close()
        await long.close()
        await server.close()


async def test_cap_closes_the_least_recently_used_idle_connection(no_leaks: None) -> None:
    pool = UpstreamPool(connect_timeout=2.0, max_idle=2, max_connections=2)
    servers = [await serve(answering(OK2)) for _ in range(3)]
    a, b, c = servers
    try:
        assert await get(pool, a) == (200, b"ok")
        assert await get(pool, b) == (200, b"ok")
        assert pool.open_connections == 2
        assert await get(pool, c) == (200, b"ok")  # at the cap: a's idle connection (the oldest) makes room
        assert pool.open_connections == 2
        assert pool.idle_connections(HOST, a.port) == 0
        assert pool.idle_connections(HOST, b.port) == pool.idle_connections(HOST, c.port) == 1
        await eventually(lambda: a.open == 0, timeout=2, interval=0.01, what="a's connection closed")
        assert await get(pool, b) == (200, b"ok")
        assert b.accepted == 1
    finally:
        await pool.close()
        for server in servers:
            await server.close()


async def test_cap_holds_waits_fail_with_a_reason_and_a_freed_slot_serves_the_next(no_leaks: None) -> None:
    go = asyncio.Event()

    async def gated(server: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await server.read_head(reader)
            await go.wait()
            writer.write(OK2)
            await writer.drain()

    waits: list[int] = []
    pool = UpstreamPool(connect_timeout=0.3, max_idle=4, max_connections=2, on_wait=lambda: waits.append(1))
    server = await serve(gated)
    try:
        busy = [asyncio.ensure_future(get(pool, server)) for _ in range(2)]
        await eventually(lambda: server.open == 2 and len(server.heads) == 2, timeout=2, interval=0.01,
                         what="two requests in flight")
        with pytest.raises(PoolFull) as info:
            await pool.request(HOST, server.port, "GET", "/", ())
        assert "upstream_max_connections" in str(info.value) and "busy" in str(info.value)
        assert server.accepted == 2 and pool.in_use == 2  # the cap held
        # A request that waits gets the slot of the first one to finish.
        pool.connect_timeout = 10.0
        waiting = asyncio.ensure_future(get(pool, server))
        await eventually(lambda: len(waits) == 2, timeout=2, interval=0.01, what="the second wait")
        go.set()
        assert [await task for task in busy] == [(200, b"ok")] * 2
        assert await waiting == (200, b"ok")
        # While a request waited, a finished connection closed rather than idled: its slot went to the waiting
        # request (whatever its node), which connected anew; never more than 2 at once.
        assert server.accepted == 3 and pool.in_use <= 2
        await eventually(lambda: server.open <= 2, timeout=2, interval=0.01, what="the closed one gone")
        assert await get(pool, server) == (200, b"ok")  # a normal request after the burst
    finally:
        go.set()
        await pool.close()
        await server.close()


async def test_raw_relays_count_under_the_cap(no_leaks: None) -> None:
    pool = UpstreamPool(connect_timeout=0.2, max_idle=2, max_connections=1)
    server = await serve(answering(OK2))
    try:
        async with pool.slot():
            assert pool.in_use == 1
            with pytest.raises(PoolFull):
                await pool.request(HOST, server.port, "GET", "/", ())
            assert server.accepted == 0
        assert pool.in_use == 0
        assert await get(pool, server) == (200, b"ok")
    finally:
        await pool.close()
        await server.close()


async def test_connect_refused(pool: UpstreamPool) -> None:
    server = await serve(answering(OK2))
    port = server.port
    await server.close()
    with pytest.raises(ConnectFailed) as info:
        await pool.request(HOST, port, "GET", "/", ())
    assert info.value.os_error is not None and info.value.os_error.errno == errno.ECONNREFUSED


async def test_close_aborts_busy_connections(no_leaks: None) -> None:
    async def stalls(server: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.read_head(reader)
        await reader.read()

    pool = UpstreamPool(connect_timeout=2.0, max_idle=2)
    server = await serve(stalls)
    try:
        tasks = [asyncio.ensure_future(pool.request(HOST, server.port, "GET", "/", ())) for _ in range(3)]
        await eventually(lambda: server.open == 3, timeout=2, interval=0.01, what="three requests")
        await pool.close()
        for task in tasks:
            with pytest.raises(RequestFailed):
                await task
        await eventually(lambda: server.open == 0, timeout=2, interval=0.01, what="the server sees the closes")
    finally:
        await server.close()


def test_on_uvloop() -> None:
    """The agent runs on uvloop: the same client, a few of the cases above, on its loop."""
    uvloop.run(asyncio.sleep(0))  # uvloop's own first-use descriptors are not this test's
    before = open_fds()

    async def main() -> None:
        pool = UpstreamPool(connect_timeout=2.0, max_idle=4)
        chunked = await serve(answering(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n"))
        odd = await serve(answering(b"HTTP/1.1 101 Switching Protocols\r\n\r\n"))
        try:
            for _ in range(3):
                assert await get(pool, chunked) == (200, b"ok")
            assert chunked.accepted == 1
            resp = await pool.request(HOST, odd.port, "GET", "/", ())
            assert resp.status == 101
            resp.release()
            assert pool.open_connections == 1  # the chunked one, idle
            resp = await pool.request(HOST, odd.port, "GET", "/", ())
            resp.release()
            assert odd.accepted == 2
        finally:
            await pool.close()
            await eventually(lambda: chunked.open == odd.open == 0, timeout=2, interval=0.01, what="all closed")
            await chunked.close()
            await odd.close()

    uvloop.run(main())
    assert open_fds() <= before
