"""A lean HTTP/1.1 client for the agent's requests to its nodes: keep-alive pools on asyncio protocols.

The agent sends one kind of request (origin-form, headers already checked by agent/checks.py, an optional
streamed body) to one kind of server (an exporter on a node it owns) and passes the answer on unchanged. A
general client's per-request machinery (sessions, cookie jars, redirects, decompression, a StreamReader per
response) is most of its cost, so this module does only that, on a plain :class:`asyncio.Protocol` per
connection, with llhttp (through httptools) parsing the responses.

What it guarantees:

* Bodies pass through unchanged (no decompression); chunked bodies arrive de-chunked, a Content-Length is
  respected, a body without either is read until the node closes the connection.
* Interim responses (1xx but 101) are skipped. A final 101, or a status outside 100-599, is handed to the
  caller, and that connection is closed and never reused.
* A connection goes back to its pool only after a complete response with keep-alive semantics (HTTP/1.1, no
  ``Connection: close``, body fully read, no stray bytes after it, request body fully sent). An idle pooled
  connection that the node closes (or that receives anything) is dropped at once; one that fails before any
  response byte on reuse is retried once on a fresh connection, for idempotent requests without a body.
* Everything is bounded: status line and header fields (8190 bytes, as aiohttp), 128 headers, 256 KiB of head
  in all, a few interim responses, the idle pool per (address, port) (the caller's per-node limit) and idle time
  (90 s by default), the connections in all (4,096 by default: at the cap the least recently used idle connection
  closes, and when all are busy a request waits up to the connect timeout, then fails with :class:`PoolFull`), and
  the body buffered ahead of the reader (reading pauses).
* Every transport is closed on every path: :meth:`Response.release` pools or aborts, cancelling a request
  aborts its connection, :meth:`UpstreamPool.close` aborts everything still open.

Errors: :class:`ConnectFailed` (no connection), :class:`PoolFull` (the cap), :class:`RequestFailed` (connected,
but no usable response head), :class:`ResponseBroken` (the body broke after the head). Deadlines are the
caller's: wrap a request in ``asyncio.timeout``.

Why this module is long and not split: one connection's protocol, the response it parses and the pool that
decides whether it may be reused are one contract (reuse is safe only if the parser saw a complete response and
the protocol nothing after it); they stay together. So does the pool's cap: a slot is freed exactly when the
protocol reports its connection closed, and an idle connection is only ever closed by the pool that holds it.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import cast

import httptools

from raven.errors import RavenError
from raven.protocol.headers import IDEMPOTENT

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

    def __init__(self, conn: _Connection, head_only: bool) -> None:
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


class _Connection(asyncio.Protocol):
    """One keep-alive connection to one node; carries one :class:`Response` at a time."""

    __slots__ = ("_drain", "_write_paused", "closed", "got_bytes", "key", "pool", "response", "transport", "used")

    def __init__(self, pool: UpstreamPool, key: tuple[str, int]) -> None:
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


class UpstreamPool:
    """Keep-alive connections to nodes, by (address, port).

    Bounds: at most ``max_idle`` idle connections per (address, port); an idle connection closes after
    ``idle_timeout`` seconds; at most ``max_connections`` connections in all (open, being opened, or reserved by
    :meth:`slot` for a raw TCP relay). At the cap, a new connection first closes the least recently used idle
    one; when every connection is busy it waits (first come, first served) up to ``connect_timeout`` and then
    fails with :class:`PoolFull`, which says why.
    """

    def __init__(self, connect_timeout: float, max_idle: int, idle_timeout: float = IDLE_TIMEOUT,
                 max_connections: int = MAX_CONNECTIONS, on_wait: Callable[[], None] | None = None) -> None:
        self.connect_timeout = connect_timeout
        self.max_idle = max_idle
        self.idle_timeout = idle_timeout
        self.max_connections = max_connections
        self.on_wait = on_wait  # called when a request has to wait for a connection (everything busy at the cap)
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._lru: dict[_Connection, float] = {}  # idle connections, oldest first -> when they became idle
        self._open: set[_Connection] = set()
        self._reserved = 0  # slots held by connects in progress and by raw relays
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._sweep: asyncio.TimerHandle | None = None

    @property
    def open_connections(self) -> int:
        return len(self._open)

    @property
    def idle_total(self) -> int:
        return len(self._lru)

    @property
    def in_use(self) -> int:
        """Slots taken: open connections plus connects in progress and raw relays."""
        return len(self._open) + self._reserved

    def idle_connections(self, address: str, port: int) -> int:
        return len(self._idle.get((address, port), ()))

    async def request(
        self,
        address: str,
        port: int,
        method: str,
        target: str,
        headers: tuple[tuple[str, str], ...],
        body: AsyncIterator[bytes] | None = None,
    ) -> Response:
        """Send a request and wait for its final response head (1xx skipped); then read the body from it and
        :meth:`Response.release` it. Raises :class:`ConnectFailed`, :class:`PoolFull` or :class:`RequestFailed`."""
        head = _request_head(method, target, headers, address, port, chunked=body is not None)
        key = (address, port)
        conn = self._take_idle(key)
        if conn is not None:
            # A pooled connection may have been closed by the node a moment ago, before we could see it: when
            # nothing of an answer came back, an idempotent request without a body is sent once more on a
            # fresh connection.
            retry = body is None and method in IDEMPOTENT
            try:
                return await self._exchange(conn, head, body, method)
            except RequestFailed:
                if not retry or conn.got_bytes:
                    raise
        conn = await self._connect(key)
        return await self._exchange(conn, head, body, method)

    def _take_idle(self, key: tuple[str, int]) -> _Connection | None:
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()
            if not idle:
                del self._idle[key]
            self._lru.pop(conn, None)
            if conn.usable:
                return conn
            conn.abort()
        return None

    # ------------------------------------------------------------ the cap

    async def _reserve(self) -> None:
        """Take one slot under ``max_connections``: a free one, else the oldest idle connection's, else wait."""
        if self.in_use >= self.max_connections and self._lru and not self._waiters:
            next(iter(self._lru)).abort()  # the least recently used idle connection makes room
        if self.in_use < self.max_connections and not self._waiters:
            self._reserved += 1
            return
        if len(self._waiters) >= self.max_connections:
            raise PoolFull(f"all {self.max_connections} connections to nodes (upstream_max_connections) are busy "
                           f"and {len(self._waiters)} requests already wait for one")
        if self.on_wait is not None:
            self.on_wait()
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout(self.connect_timeout):
                await waiter  # _hand_over reserved the slot for us
        except BaseException as exc:
            if waiter.done() and not waiter.cancelled():
                self._release()  # handed over, but we leave: pass it on
            else:
                waiter.cancel()
                with contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)
            if isinstance(exc, TimeoutError):
                raise PoolFull(f"waited {self.connect_timeout:.1f}s for one of the agent's "
                               f"{self.max_connections} connections to nodes (upstream_max_connections): all "
                               "busy") from None
            raise

    def _release(self) -> None:
        self._reserved -= 1
        self._hand_over()

    def _hand_over(self) -> None:
        """A slot may be free: give it to the longest waiter (reserved on its behalf)."""
        while self._waiters and self.in_use < self.max_connections:
            waiter = self._waiters.popleft()
            if not waiter.done():
                self._reserved += 1
                waiter.set_result(None)

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Hold one connection slot while relaying raw TCP to a node (its descriptor counts under the cap)."""
        await self._reserve()
        try:
            yield
        finally:
            self._release()

    # ------------------------------------------------------------ connections

    async def _connect(self, key: tuple[str, int]) -> _Connection:
        await self._reserve()
        try:
            address, port = key
            loop = asyncio.get_running_loop()
            conn = _Connection(self, key)
            try:
                async with asyncio.timeout(self.connect_timeout):
                    transport, _ = await loop.create_connection(lambda: conn, address, port)
            except TimeoutError:
                conn.abort()
                raise ConnectFailed(f"connecting timed out after {self.connect_timeout:.1f}s", None) from None
            except OSError as exc:
                raise ConnectFailed(str(exc), exc) from exc
            except BaseException:
                conn.abort()
                raise
            # uvloop may call connection_made only after create_connection has returned.
            conn.transport = transport
            if conn.closed:  # lost before it was ours: it never counts
                transport.abort()
                raise RequestFailed("node closed the connection before the request was sent")
            self._open.add(conn)
            return conn
        finally:
            self._reserved -= 1  # the slot is now the open connection's (or free again)
            self._hand_over()

    async def _exchange(
        self, conn: _Connection, head: bytes, body: AsyncIterator[bytes] | None, method: str
    ) -> Response:
        assert conn.transport is not None
        response = Response(conn, head_only=method == "HEAD")
        conn.response = response
        conn.got_bytes = False
        conn.used += 1
        try:
            conn.transport.write(head)
            if body is not None:
                response._sending = asyncio.ensure_future(self._send_body(conn, response, body))
            await response._head()
        except BaseException:
            response.release()  # not complete: the connection is closed, the body's writer cancelled
            raise
        return response

    @staticmethod
    async def _send_body(conn: _Connection, response: Response, body: AsyncIterator[bytes]) -> None:
        try:
            await conn.send_body(body)
        except Exception as exc:
            # The body could not be sent (the stream was reset, the node closed): the response cannot be
            # trusted to be complete either, and the connection is closed.
            response._send_error = exc
            text = f"sending the request body failed: {type(exc).__name__}: {str(exc).split(chr(10), 1)[0]}"
            response._fail(ResponseBroken(text) if response._final else RequestFailed(text))
            response._wake()

    def put(self, conn: _Connection) -> None:
        """A connection that finished a response cleanly: keep it for the next request to its address, unless
        a request waits for a slot (then it closes, and the slot is that request's)."""
        idle = self._idle.setdefault(conn.key, [])
        if not conn.usable or len(idle) >= self.max_idle or self._waiters:
            if not idle:
                del self._idle[conn.key]
            conn.abort()
            return
        idle.append(conn)
        loop = asyncio.get_running_loop()
        self._lru[conn] = loop.time()
        if self._sweep is None:
            self._sweep = loop.call_at(loop.time() + self.idle_timeout, self._expire)

    def _expire(self) -> None:
        """Close the connections idle for ``idle_timeout``; one timer for all of them (oldest first)."""
        self._sweep = None
        loop = asyncio.get_running_loop()
        deadline = loop.time() - self.idle_timeout
        while self._lru:
            conn, since = next(iter(self._lru.items()))
            if since > deadline:
                self._sweep = loop.call_at(since + self.idle_timeout, self._expire)
                return
            conn.abort()  # forget() takes it out of _lru

    def forget(self, conn: _Connection) -> None:
        """A connection closed: it leaves the pool, and its slot goes to a waiting request if there is one."""
        self._lru.pop(conn, None)
        idle = self._idle.get(conn.key)
        if idle and conn in idle:
            idle.remove(conn)
            if not idle:
                del self._idle[conn.key]
        if conn in self._open:
            self._open.discard(conn)
            self._hand_over()

    async def close(self) -> None:
        """Close every connection, idle or busy."""
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        for conn in list(self._open):
            conn.abort()
        self._idle.clear()
        self._lru.clear()
        await asyncio.sleep(0)  # let the transports run their connection_lost


def _request_head(
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
        host = f"[{address}]" if ":" in address else address
        lines.insert(1, f"Host: {host}\r\n" if port == 80 else f"Host: {host}:{port}\r\n")
    if chunked:
        lines.append("Transfer-Encoding: chunked\r\n")
    elif method not in _NO_BODY_METHODS:
        lines.append("Content-Length: 0\r\n")
    lines.append("\r\n")
    return "".join(lines).encode("utf-8")

