"""One keep-alive HTTP/1.1 connection to a node (an :class:`asyncio.Protocol`), the :class:`Response` parsed on it
with llhttp (through httptools), the request head written to it, and the errors of both.

Reuse is safe only if the parser saw a complete response and the protocol nothing after it: the connection
and its response are one contract, kept here; the pool that decides reuse (agent/upstream.py) asks
:meth:`Response.complete` and :meth:`Connection.usable`, and is told of every close through
:meth:`Keeper.forget`, so that a slot is freed exactly when the protocol reports its connection closed.
"""

from __future__ import annotations

import asyncio
import re
from collections import deque
from collections.abc import AsyncIterator
from typing import Protocol, cast

import httptools

from raven.errors import RavenError
from raven.hostport import url_host


class Keeper(Protocol):
    """What a connection asks of the pool that holds it (agent/upstream.py's ``UpstreamPool``)."""

    def put(self, conn: Connection) -> None:
        """The connection finished a response cleanly and may carry another."""

    def forget(self, conn: Connection) -> None:
        """The connection closed: it leaves the pool."""

MAX_LINE = 8190  # status line (aiohttp's max_line_size)
MAX_FIELD = 8190  # one header, name and value (aiohttp's max_field_size)
MAX_HEADERS = 128  # aiohttp's max_headers
MAX_HEAD = 256 * 1024  # bytes before the final head is complete, interim responses included
MAX_INTERIM = 8  # 1xx responses before the final one
IDLE_TIMEOUT = 90.0  # seconds a pooled connection waits for its next request (the agent's upstream_idle_timeout)
MAX_CONNECTIONS = 4096  # connections to nodes at once, all nodes together (the agent's upstream_max_connections)
READ_HIGH = 256 * 1024  # body bytes buffered ahead of the reader: pause reading above, resume below LOW
READ_LOW = 64 * 1024
_NO_BODY_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "TRACE"})  # others say Content-Length: 0 when empty
_FORBIDDEN = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")  # as aiohttp: no control characters but TAB


class UpstreamError(RavenError):
    """A request to a node failed; the message names what happened, never the request's headers."""


class ConnectFailed(UpstreamError):
    """No connection to the node: ``os_error`` is the socket error, None when the connect timed out."""

    def __init__(self, message: str, os_error: OSError | None) -> None:
        super().__init__(message)
        self.os_error = os_error


class RequestFailed(UpstreamError):
    """Connected, but the node gave no usable response head (closed, reset, malformed, over a limit)."""


class PoolFull(UpstreamError):
    """Every one of the agent's connections to nodes (``upstream_max_connections``) is busy."""


class ResponseBroken(UpstreamError):
    """The response broke after its head: closed or malformed mid-body."""


class _Stop(RavenError):
    """Raised inside a parser callback to stop parsing: the response is settled."""


_HEAD, _BODY, _DONE, _FAILED = range(4)


class Response:
    """One request's response on one connection: its head once awaited, then its body by :meth:`read`."""

    __slots__ = (
        "_buffered", "_chunks", "_conn", "_error", "_final", "_head_bytes", "_head_only", "_header_count",
        "_interim", "_keep_alive", "_parser", "_paused", "_reason", "_send_error", "_sending", "_state", "_waiter",
        "headers", "reason", "status",
    )

    def __init__(self, conn: Connection, head_only: bool) -> None:
        self._conn = conn
        self._head_only = head_only
        self._parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.reason = ""
        self.headers: list[tuple[bytes, bytes]] = []
        self._reason = b""
        self._header_count = 0
        self._head_bytes = 0
        self._interim = 0
        self._final = False
        self._keep_alive = False
        self._state = _HEAD
        self._error: UpstreamError | None = None
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._paused = False
        self._waiter: asyncio.Future[None] | None = None
        self._sending: asyncio.Task[None] | None = None  # the request body's writer, when there is one
        self._send_error: BaseException | None = None

    # ------------------------------------------------------------ llhttp callbacks

    def on_message_begin(self) -> None:
        if self._state != _HEAD:
            # Bytes after a complete response that nobody asked for: never reuse this connection.
            self._keep_alive = False
            raise _Stop
        self._reason = b""
        self.headers = []
        self._header_count = 0

    def on_status(self, reason: bytes) -> None:
        self._reason += reason
        if len(self._reason) > MAX_LINE:
            self._raise(RequestFailed(f"response status line is longer than {MAX_LINE} bytes"))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        if self._header_count > MAX_HEADERS:
            self._raise(RequestFailed(f"response head has more than {MAX_HEADERS} headers"))
        if len(name) + len(value) > MAX_FIELD:
            self._raise(RequestFailed(f"response header {name[:40]!r} is longer than {MAX_FIELD} bytes"))
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if 100 <= status < 200 and status != 101:
            self._interim += 1
            if self._interim > MAX_INTERIM:
                self._raise(RequestFailed(f"more than {MAX_INTERIM} interim (1xx) responses"))
            return  # llhttp ends the interim message here; the next one is the real answer (or another 1xx)
        self.status = status
        self.reason = self._reason.decode("latin-1")
        self._final = True
        if self._head_only or status == 101 or not 200 <= status <= 599:
            # A HEAD answer has no body whatever its headers say; an odd status ends the exchange: the caller
            # resets the stream, and the connection is in an unknown state, so it is never reused.
            self._state = _DONE
            self._keep_alive = False
            raise _Stop
        self._state = _BODY

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)
        self._buffered += len(body)

    def on_message_complete(self) -> None:
        if not self._final:
            return  # an interim response
        parser = self._parser
        self._keep_alive = parser.should_keep_alive() and parser.get_http_version() == "1.1"
        self._state = _DONE

    def _raise(self, error: UpstreamError) -> None:
        self._error = error
        raise _Stop

    # ------------------------------------------------------------ the connection's events

    def feed(self, data: bytes) -> None:
        if self._state >= _DONE:
            self._keep_alive = False  # stray bytes after the response
            return
        head = self._state == _HEAD
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserCallbackError:
            if self._error is not None:
                self._fail(self._error)
        except httptools.HttpParserUpgrade:
            pass  # only after a final 101, which on_headers_complete settled already
        except httptools.HttpParserError as exc:
            if self._state < _DONE:
                self._fail(self._error or _parse_error(exc, self._state))
        if head and self._state == _HEAD:
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD:
                self._fail(RequestFailed(f"response head is longer than {MAX_HEAD} bytes"))
        if self._buffered > READ_HIGH and not self._paused and self._state == _BODY:
            self._paused = True
            self._conn.pause_reading()
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._state == _BODY and self._chunks_until_close():
            self._keep_alive = False
            self._state = _DONE  # the node closed the connection: that ends a body framed by the close
        elif self._state < _DONE:
            if self._state == _HEAD:
                why = "closed the connection before answering" if exc is None else f"reset the connection: {exc}"
                self._fail(RequestFailed(f"node {why}"))
            else:
                why = "closed the connection mid-body" if exc is None else f"connection broke mid-body: {exc}"
                self._fail(ResponseBroken(why))
        self._wake()

    def _chunks_until_close(self) -> bool:
        """The body is framed by the connection's close (no Content-Length, not chunked)."""
        return not self._parser.should_keep_alive() and not any(
            name.lower() in (b"content-length", b"transfer-encoding") for name, _ in self.headers)

    def _fail(self, error: UpstreamError) -> None:
        if self._state >= _DONE:
            return
        self._error = error
        self._state = _FAILED
        self._keep_alive = False
        self._conn.abort()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _wait(self) -> None:
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    # ------------------------------------------------------------ the caller's side

    async def _head(self) -> None:
        while self._state == _HEAD:
            await self._wait()
        if self._state == _FAILED and not self._final:
            assert self._error is not None
            raise self._error

    async def read(self) -> tuple[bytes, bool]:
        """The next piece of the body and whether it is the last one; ``(b"", True)`` at the end.

        Raises :class:`ResponseBroken` once the pieces that arrived before the break have been read.
        """
        while True:
            if self._chunks:
                chunk = self._chunks.popleft()
                self._buffered -= len(chunk)
                if self._paused and self._buffered < READ_LOW:
                    self._paused = False
                    self._conn.resume_reading()
                return chunk, not self._chunks and self._state == _DONE
            if self._state == _DONE:
                return b"", True
            if self._state == _FAILED:
                assert self._error is not None
                raise self._error
            await self._wait()

    @property
    def complete(self) -> bool:
        """The whole response was received (its body may still be buffered)."""
        return self._state == _DONE

    def release(self) -> None:
        """Done with this response: its connection goes back to the pool when it can carry another request,
        else it is closed. Idempotent; call it on every path."""
        conn = self._conn
        if conn.response is not self:
            return
        conn.response = None
        sending = self._sending
        reusable = (
            self._state == _DONE and self._keep_alive and not self._chunks
            and (sending is None or sending.done()) and self._send_error is None
        )
        if sending is not None and not sending.done():
            sending.cancel()
        if reusable:
            conn.pool.put(conn)
        else:
            conn.abort()


def _parse_error(exc: httptools.HttpParserError, state: int) -> UpstreamError:
    text = str(exc) or type(exc).__name__
    if state == _HEAD:
        return RequestFailed(f"malformed response head: {text}")
    return ResponseBroken(f"malformed response body: {text}")


class Connection(asyncio.Protocol):
    """One keep-alive connection to one node; carries one :class:`Response` at a time."""

    __slots__ = ("_drain", "_write_paused", "closed", "got_bytes", "key", "pool", "response", "transport", "used")

    def __init__(self, pool: Keeper, key: tuple[str, int]) -> None:
        self.pool = pool
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.response: Response | None = None
        self.closed = False
        self.used = 0  # requests sent on this connection
        self.got_bytes = False  # the current request's answer has begun
        self._drain: asyncio.Future[None] | None = None
        self._write_paused = False

    # ------------------------------------------------------------ asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not asyncio.Transport's

    def data_received(self, data: bytes) -> None:
        response = self.response
        if response is None:
            self.abort()  # an idle connection that speaks unasked is in no state to carry a request
            return
        self.got_bytes = True
        response.feed(data)

    def eof_received(self) -> bool:
        return False  # the transport closes itself; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool.forget(self)
        if self.response is not None:
            self.response.connection_lost(exc)
        drain = self._drain
        if drain is not None and not drain.done():
            drain.set_result(None)

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        drain = self._drain
        if drain is not None and not drain.done():
            drain.set_result(None)

    # ------------------------------------------------------------ helpers

    @property
    def usable(self) -> bool:
        return not self.closed and self.transport is not None and not self.transport.is_closing()

    def pause_reading(self) -> None:
        if self.usable:
            assert self.transport is not None
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.usable:
            assert self.transport is not None
            self.transport.resume_reading()

    def abort(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.abort()
        self.closed = True
        self.pool.forget(self)

    async def drain(self) -> None:
        while self._write_paused and not self.closed:
            self._drain = asyncio.get_running_loop().create_future()
            try:
                await self._drain
            finally:
                self._drain = None
        if self.closed:
            raise ConnectionResetError("the node closed the connection")

    async def send_body(self, body: AsyncIterator[bytes]) -> None:
        """Send a streamed request body, chunked (the node sees the body as it arrives)."""
        assert self.transport is not None
        transport = self.transport
        async for chunk in body:
            if not chunk:
                continue
            await self.drain()
            transport.writelines((b"%x\r\n" % len(chunk), chunk, b"\r\n"))
        await self.drain()
        transport.write(b"0\r\n\r\n")


def request_head(
    method: str, target: str, headers: tuple[tuple[str, str], ...], address: str, port: int, chunked: bool
) -> bytes:
    lines = [f"{method} {target} HTTP/1.1\r\n"]
    has_host = False
    for name, value in headers:
        if _FORBIDDEN.search(name) or _FORBIDDEN.search(value):
            raise ValueError("Forbidden control character detected in headers. Potential header injection attack.")
        if not has_host and name.lower() == "host":
            has_host = True
        lines.append(f"{name}: {value}\r\n")
    if not has_host:
        host = url_host(address)
        lines.insert(1, f"Host: {host}\r\n" if port == 80 else f"Host: {host}:{port}\r\n")
    if chunked:
        lines.append("Transfer-Encoding: chunked\r\n")
    elif method not in _NO_BODY_METHODS:
        lines.append("Content-Length: 0\r\n")
    lines.append("\r\n")
    return "".join(lines).encode("utf-8")
