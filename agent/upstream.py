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

The parts: this module holds the pool (:class:`UpstreamPool`: idle connections per node, the cap on all of
them, reuse); agent/upstreamconn.py one connection, the response parsed on it, and the errors (re-exported here).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator, Callable

from agent.upstreamconn import (
    IDLE_TIMEOUT,
    MAX_CONNECTIONS,
    MAX_FIELD,
    MAX_HEAD,
    MAX_HEADERS,
    MAX_INTERIM,
    MAX_LINE,
    READ_HIGH,
    READ_LOW,
    ConnectFailed,
    Connection,
    PoolFull,
    RequestFailed,
    Response,
    ResponseBroken,
    UpstreamError,
    request_head,
)
from raven.http.guard import GROWTH_STEP
from raven.protocol import IDEMPOTENT

__all__ = [
    "IDLE_TIMEOUT",
    "MAX_CONNECTIONS",
    "MAX_FIELD",
    "MAX_HEAD",
    "MAX_HEADERS",
    "MAX_INTERIM",
    "MAX_LINE",
    "READ_HIGH",
    "READ_LOW",
    "ConnectFailed",
    "PoolFull",
    "RequestFailed",
    "Response",
    "ResponseBroken",
    "UpstreamError",
    "UpstreamPool",
]


class UpstreamPool:
    """Keep-alive connections to nodes, by (address, port).

    Bounds: at most ``max_idle`` idle connections per (address, port); an idle connection closes after
    ``idle_timeout`` seconds; at most ``max_connections`` connections in all (open, being opened, or reserved by
    :meth:`slot` for a raw TCP relay). At the cap, a new connection first closes the least recently used idle
    one; when every connection is busy it waits (first come, first served) up to ``connect_timeout`` and then
    fails with :class:`PoolFull`, which says why.

    Keep-alive connections are long-lived state (each holds a protocol, a parser, a transport and their buffers,
    which the garbage collector tracks): ``on_grown`` is called when the open connections grew by a step
    (``GROWTH_STEP``, or an eighth of them) above the mark of the last call, the mark following them down as they
    close (as :class:`~raven.http.guard.ConnectionGuard` does for the gateway's front end); the agent wires it
    to ``raven.ops.gcpause.settle_soon``, which freezes them out of the collector's way. Churn below the mark (a
    connection closed and another opened) does not call it.
    """

    def __init__(self, connect_timeout: float, max_idle: int, idle_timeout: float = IDLE_TIMEOUT,
                 max_connections: int = MAX_CONNECTIONS, on_wait: Callable[[], None] | None = None,
                 on_grown: Callable[[], None] | None = None) -> None:
        self.connect_timeout = connect_timeout
        self.max_idle = max_idle
        self.idle_timeout = idle_timeout
        self.max_connections = max_connections
        self.on_wait = on_wait  # called when a request has to wait for a connection (everything busy at the cap)
        self.on_grown = on_grown
        self._grown_from = 0  # open connections at the last on_grown (lowered as they close)
        self._idle: dict[tuple[str, int], list[Connection]] = {}
        self._lru: dict[Connection, float] = {}  # idle connections, oldest first -> when they became idle
        self._open: set[Connection] = set()
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
        head = request_head(method, target, headers, address, port, chunked=body is not None)
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

    def _take_idle(self, key: tuple[str, int]) -> Connection | None:
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

    def slot(self) -> Slot:
        """Hold one connection slot while relaying raw TCP to a node (its descriptor counts under the cap):
        ``async with pool.slot():``."""
        return Slot(self)

    # ------------------------------------------------------------ connections

    async def _connect(self, key: tuple[str, int]) -> Connection:
        await self._reserve()
        try:
            address, port = key
            loop = asyncio.get_running_loop()
            conn = Connection(self, key)
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
            if self.on_grown is not None and len(self._open) - self._grown_from >= max(GROWTH_STEP,
                                                                                       self._grown_from // 8):
                self._grown_from = len(self._open)
                self.on_grown()
            return conn
        finally:
            self._reserved -= 1  # the slot is now the open connection's (or free again)
            self._hand_over()

    async def _exchange(
        self, conn: Connection, head: bytes, body: AsyncIterator[bytes] | None, method: str
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
    async def _send_body(conn: Connection, response: Response, body: AsyncIterator[bytes]) -> None:
        try:
            await conn.send_body(body)
        except Exception as exc:
            # The body could not be sent (the stream was reset, the node closed): the response cannot be
            # trusted to be complete either, and the connection is closed.
            response._send_error = exc
            text = f"sending the request body failed: {type(exc).__name__}: {str(exc).split(chr(10), 1)[0]}"
            response._fail(ResponseBroken(text) if response._final else RequestFailed(text))
            response._wake()

    def put(self, conn: Connection) -> None:
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

    def forget(self, conn: Connection) -> None:
        """A connection closed: it leaves the pool, and its slot goes to a waiting request if there is one."""
        self._lru.pop(conn, None)
        idle = self._idle.get(conn.key)
        if idle and conn in idle:
            idle.remove(conn)
            if not idle:
                del self._idle[conn.key]
        if conn in self._open:
            self._open.discard(conn)
            self._grown_from = min(self._grown_from, len(self._open))
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


class Slot:
    """One connection slot of a pool held for the body of an ``async with`` (:meth:`UpstreamPool.slot`): taken on
    entry (it may wait, or raise :class:`PoolFull`; nothing is held then), given back on every way out. A class
    rather than an ``@asynccontextmanager``, whose async generator mypyc does not compile."""

    def __init__(self, pool: UpstreamPool) -> None:
        self._pool = pool

    async def __aenter__(self) -> None:
        await self._pool._reserve()

    async def __aexit__(self, *exc_info: object) -> None:
        self._pool._release()
