"""The lean HTTP/1.1 server of the front port: llhttp (raven/http/h1.py) under an asyncio protocol.

One :class:`LeanProtocol` per connection, inside the connection guard's protocol (raven/http/guard.py: the
caps, the head and idle deadlines, the eviction and the drain stay there, written once). Per request it makes a
:class:`LeanCall` (a :class:`~raven.http.call.ServerCall`) and one task running the handler; the requests of a
connection are answered one after another in their order (pipelining), and its reading pauses while more than
``HIGH`` bytes of requests wait. Every deadline of a request (the guard's head and idle ones, the handler's body,
answer and write-stall ones) runs on the connection's one :class:`~raven.http.clock.Clock`.

A response head leaves with its first body bytes in one ``transport.write``; writes wait for the transport's
flow control (``pause_writing``/``resume_writing``), each until its deadline, so a client that stops reading
holds at most a transport's high-water mark of the answer. A request the parser refuses is answered with a
400 (or 431) that says why, logged by ``on_malformed``, and the connection closed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Protocol, cast

from multidict import CIMultiDictProxy

from raven.aio import reset_connection
from raven.http.call import Feeder, HeaderList
from raven.http.clock import Clock, Timeout
from raven.http.guard import ConnectionGuard
from raven.http.h1 import BadRequest, ParsedRequest, RequestReader, canned, response_head

__all__ = ["LeanCall", "LeanProtocol", "LeanServer"]

log = logging.getLogger("raven.http.h1server")

HIGH = 256 * 1024  # request bytes (bodies, pipelined requests) a connection holds before its reading pauses
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


class _Guarded(Protocol):
    """The guard's side of a connection (raven/http/guard.py): its phases and its one timer."""

    clock: Clock

    def busy(self) -> None: ...

    def idle(self, owes_head: bool = False) -> None: ...


class LeanServer:
    """Makes the protocol of each connection (give it to :meth:`ConnectionGuard.wrap`) and runs ``handler``."""

    def __init__(self, handler: Callable[[LeanCall], Awaitable[None]], guard: ConnectionGuard, max_field: int,
                 max_head: int, on_malformed: Callable[[str, str], None]) -> None:
        self.handler = handler
        self.guard = guard
        self.max_field = max_field
        self.max_head = max_head
        self.on_malformed = on_malformed
        self.tasks: set[asyncio.Task[None]] = set()
        self.connections: set[LeanProtocol] = set()

    def __call__(self) -> LeanProtocol:
        return LeanProtocol(self)

    def pre_shutdown(self) -> None:
        """Close the connections that wait for a next request (the runner stops; aiohttp's ``Server`` does so)."""
        for proto in list(self.connections):
            if proto.quiet() and proto._transport is not None:
                proto._transport.close()

    async def shutdown(self, timeout: float) -> None:
        """Give the requests being answered ``timeout`` seconds, then cancel them and close every connection."""
        if self.tasks:
            await asyncio.wait(list(self.tasks), timeout=timeout)
        for task in list(self.tasks):
            task.cancel()
        if self.tasks:
            await asyncio.wait(list(self.tasks), timeout=1.0)
        for proto in list(self.connections):
            if proto._transport is not None:
                proto._transport.abort()


class LeanProtocol(asyncio.Protocol):
    __slots__ = ("_body_waiter", "_call", "_clock", "_conn", "_drain_waiter", "_error", "_feeder", "_lost",
                 "_next_on_resume", "_paused_reading", "_paused_writing", "_reader", "_remote", "_secure", "_server",
                 "_transport")

    def __init__(self, server: LeanServer) -> None:
        self._server = server
        self._reader = RequestReader(server.max_field, server.max_head)
        self._transport: asyncio.Transport | None = None
        self._conn: _Guarded | None = None  # the guard's protocol around this one
        self._clock: Clock | None = None
        self._call: LeanCall | None = None
        self._feeder: Feeder | None = None
        self._error: BadRequest | None = None
        self._body_waiter: asyncio.Future[None] | None = None
        self._drain_waiter: asyncio.Future[None] | None = None
        self._paused_writing = False
        self._next_on_resume = False  # a request waits for the client to read what it was sent
        self._paused_reading = False
        self._lost = False
        self._remote: str | None = None
        self._secure = False

    # ---------------------------------------------------------------- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport = cast(asyncio.Transport, transport)
        self._server.connections.add(self)
        peer = transport.get_extra_info("peername")
        self._remote = str(peer[0]) if isinstance(peer, tuple) and peer else None
        self._secure = transport.get_extra_info("sslcontext") is not None
        conn = self._server.guard.connection(transport)
        self._conn = conn
        self._clock = conn.clock if conn is not None else Clock(asyncio.get_running_loop())

    def data_received(self, data: bytes) -> None:
        if self._feeder is not None:
            self._feeder.feed_data(data)
            return
        if self._error is not None or self._lost:
            return
        reader = self._reader
        try:
            reader.feed(data)
        except BadRequest as exc:
            self._error = exc
            self._server.on_malformed(self._remote or "?", f"{exc.status}: {exc.reason}")
        if self._call is None:
            self._next()
        else:
            self._wake_body()
        self._hold()

    def eof_received(self) -> bool | None:
        if self._feeder is not None:
            self._feeder.feed_eof()
            return True  # half-closed: the node's answer still goes back
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        self._server.connections.discard(self)
        if self._feeder is not None:
            self._feeder.feed_eof()
        for waiter in (self._body_waiter, self._drain_waiter):
            if waiter is not None and not waiter.done():
                waiter.set_exception(ConnectionResetError("client connection lost"))
                waiter.exception()  # retrieved: nobody may be waiting any more
        self._body_waiter = self._drain_waiter = None
        call = self._call
        if call is not None and call.task is not None:
            call.task.cancel()  # the client left: its request is given up, the node's stream released
        self._reader.ready.clear()
        if self._conn is None and self._clock is not None:
            self._clock.close()

    def pause_writing(self) -> None:
        self._paused_writing = True

    def resume_writing(self) -> None:
        self._paused_writing = False
        waiter, self._drain_waiter = self._drain_waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        if self._next_on_resume and self._call is None:
            self._next_on_resume = False
            self._next()

    # ---------------------------------------------------------------- the guard's questions

    def quiet(self) -> bool:
        """Nothing of a next request has arrived and none is being answered (raven/http/quiet.py)."""
        return self._call is None and not self._reader.ready and not self._reader.in_head

    async def _drain_helper(self) -> None:
        """Wait until the transport takes writes again (the name the guard's ``drained`` calls, as aiohttp's)."""
        if self._lost:
            raise ConnectionResetError("client connection lost")
        if not self._paused_writing:
            return
        waiter = self._drain_waiter
        if waiter is None:
            waiter = self._drain_waiter = asyncio.get_running_loop().create_future()
        await asyncio.shield(waiter)

    # ---------------------------------------------------------------- requests, one after another

    def _next(self) -> None:
        transport = self._transport
        if transport is None or self._lost or transport.is_closing():
            return
        if self._paused_writing:  # the client does not read its answers: no next one until it does (the
            self._next_on_resume = True  # guard's write-stall deadline resets a client that never reads)
            return
        if self._reader.ready:
            request = self._reader.ready.popleft()
            call = self._call = LeanCall(self, request)
            if self._conn is not None:
                self._conn.busy()
            task = call.task = asyncio.get_running_loop().create_task(self._serve(call))
            self._server.tasks.add(task)
            task.add_done_callback(self._server.tasks.discard)
        elif self._error is not None:
            error = self._error
            transport.write(canned(error.status, error.reason))
            transport.close()  # the guard's deadline still runs: a client that reads nothing of this is reset

    async def _serve(self, call: LeanCall) -> None:
        try:
            await self._server.handler(call)
        except asyncio.CancelledError:
            if not self._lost:
                raise
        except ConnectionError:
            call.abort()
        except BadRequest as exc:  # the request's body broke the HTTP framing while the handler read it
            if call.started:
                call.abort()
            else:
                call.respond(exc.status, (("Content-Type", "text/plain; charset=utf-8"),),
                             f"raven: {exc.reason}\n".encode(), True)
        except Exception:
            log.exception("front-end request %s %s from %s failed", call.method[:20], call.raw_path[:80],
                          call.remote)
            if call.started:
                call.abort()
            else:
                call.respond(500, (), b"raven: internal error (logged)\n", True)
        finally:
            self._finished(call)

    def _finished(self, call: LeanCall) -> None:
        self._call = None
        transport = self._transport
        request = call.request
        if transport is None or self._lost:
            return
        if not call.started:  # the handler said nothing: a bug, not a hang
            call.respond(500, (), b"raven: no answer\n", True)
        unread = request.has_body and not (request.done and not request.chunks)
        if call.close or unread or not request.keep_alive or self._reader.tunnel:
            transport.close()  # a body left unread cannot be told from the next request: the connection ends
        self._resume()
        if self._conn is not None:
            self._conn.idle(self._reader.in_head or bool(self._reader.ready))
        if not transport.is_closing():
            self._next()

    # ---------------------------------------------------------------- reading

    def _held(self) -> int:
        """Bytes of requests the connection holds, not taken yet (a queued request's head counted as 1 KiB)."""
        reader = self._reader
        held = sum(r.buffered for r in reader.ready) + 1024 * len(reader.ready)
        if reader.upgraded is not None and reader.upgraded.tunnel:
            held += len(reader.upgraded.tunnel)
        if self._call is not None:
            held += self._call.request.buffered
        return held

    def _hold(self) -> None:
        """Pause reading while the connection holds more than HIGH bytes of requests not taken yet."""
        if not self._paused_reading and self._transport is not None and self._held() > HIGH:
            self._paused_reading = True
            self._transport.pause_reading()

    def _resume(self) -> None:
        """Read again once what is held fell to half of HIGH (not at each answer: a pipelined flood would get
        one more read in per request answered)."""
        if self._paused_reading and self._transport is not None and not self._lost and self._held() <= HIGH // 2:
            self._paused_reading = False
            self._transport.resume_reading()

    def _wake_body(self) -> None:
        waiter, self._body_waiter = self._body_waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def body(self, request: ParsedRequest) -> bytes:
        while True:
            if request.chunks:
                data = b"".join(request.chunks)
                request.chunks.clear()
                request.buffered = 0
                self._resume()
                return data
            if request.done:
                return b""
            if self._error is not None:  # its body broke the framing: the handler gives up, the client gets why
                raise self._error
            if self._lost:
                raise ConnectionResetError("the client left before the end of its request body")
            waiter = self._body_waiter = asyncio.get_running_loop().create_future()
            await waiter

    def take_over(self, feeder: Feeder, request: ParsedRequest) -> None:
        self._feeder = feeder
        first, request.tunnel = request.tunnel, None
        if first:
            feeder.feed_data(first)
        if self._paused_reading and self._transport is not None and not self._lost:  # the tunnel's own flow now
            self._paused_reading = False
            self._transport.resume_reading()


class LeanCall:
    """One request on a :class:`LeanProtocol`: what the handler reads and how it answers."""

    __slots__ = ("_chunked", "_continued", "_left", "_no_body", "_proto", "close", "request", "started", "task")

    def __init__(self, proto: LeanProtocol, request: ParsedRequest) -> None:
        self._proto = proto
        self.request = request
        self.task: asyncio.Task[None] | None = None
        self.started = False  # a response head went out
        self.close = not request.keep_alive
        self._chunked = False
        self._continued = False
        self._no_body = False  # an answer to HEAD, a 204 or a 304: body bytes are never sent
        self._left = -1  # body bytes the Content-Length still allows (-1: no Content-Length)

    @property
    def method(self) -> str:
        return self.request.method

    @property
    def raw_path(self) -> str:
        return self.request.target

    @property
    def headers(self) -> CIMultiDictProxy[str]:
        return self.request.headers

    @property
    def version(self) -> tuple[int, int]:
        return self.request.version

    @property
    def remote(self) -> str | None:
        return self._proto._remote

    @property
    def secure(self) -> bool:
        return self._proto._secure

    @property
    def body_exists(self) -> bool:
        return self.request.has_body

    @property
    def transport(self) -> asyncio.Transport | None:
        return self._proto._transport

    def timeout(self, at: float) -> Timeout:
        clock = self._proto._clock
        assert clock is not None
        loop = asyncio.get_running_loop()
        return Timeout(clock, loop.time() + (at - time.monotonic()))

    async def read(self) -> bytes:
        request = self.request
        if not request.has_body:
            return b""
        if request.expect_continue and not self._continued and not request.chunks and not request.done:
            self._continued = True
            transport = self.transport
            if transport is not None and not transport.is_closing():
                transport.write(_CONTINUE)
        return await self._proto.body(request)

    def _head(self, status: int, reason: str, headers: HeaderList, framing: tuple[str, str] | None) -> bytes:
        fields = list(headers)
        if framing is not None:
            fields.append(framing)
        if self.close:
            fields.append(("Connection", "close"))
        elif self.request.version < (1, 1):
            fields.append(("Connection", "keep-alive"))
        self.started = True
        return response_head(status, reason, fields)

    def respond(self, status: int, headers: HeaderList, body: bytes, close: bool) -> None:
        self.close = self.close or close
        transport = self.transport
        framing = ("Content-Length", str(len(body)))
        if self.method == "HEAD":
            body = b""
        if transport is not None and not transport.is_closing():
            transport.write(self._head(status, "", headers, framing) + body)

    async def send(self, status: int, reason: str, headers: HeaderList, length: int | None, first: bytes,
                   close: bool, until: float, last: bool = False) -> None:
        self.close = self.close or close
        self._no_body = self.method == "HEAD" or status in (204, 304)
        framing: tuple[str, str] | None
        if length is not None:
            framing, self._left = ("Content-Length", str(length)), length
        elif self.request.version >= (1, 1) and first:
            framing, self._chunked = ("Transfer-Encoding", "chunked"), True
        elif self.request.version >= (1, 1) and (self.method == "HEAD" or status in (204, 304)):
            framing = None
        else:
            framing, self.close = None, True  # an HTTP/1.0 body ends with the connection
        head = self._head(status, reason, headers, framing)
        await self.write(first, until, head, last)

    async def write(self, chunk: bytes | memoryview, until: float, head: bytes = b"", last: bool = False) -> None:
        transport = self.transport
        if transport is None or self._proto._lost:
            raise ConnectionResetError("client connection lost")
        if self._no_body:
            chunk = b""
        elif self._left >= 0:  # never past the Content-Length: bytes after it would be read as the next answer
            if len(chunk) > self._left:
                chunk = chunk[:self._left]
            self._left -= len(chunk)
        if chunk and self._chunked:
            end = b""
            if last:  # the whole body: its last chunk goes in the same write
                end, self._chunked = b"0\r\n\r\n", False
            transport.write(b"%s%x\r\n%s\r\n%s" % (head, len(chunk), chunk, end))
        elif head:
            transport.write(head + chunk)
        elif chunk:
            transport.write(chunk)
        if self._proto._paused_writing:
            async with self.timeout(until):
                await self._proto._drain_helper()

    async def end(self, until: float) -> None:
        transport = self.transport
        if transport is None or self._proto._lost:
            raise ConnectionResetError("client connection lost")
        if self._chunked:
            self._chunked = False
            transport.write(b"0\r\n\r\n")
        if self._proto._paused_writing:
            async with self.timeout(until):
                await self._proto._drain_helper()

    def abort(self) -> None:
        self.close = True
        transport = self.transport
        if transport is not None:
            reset_connection(transport)

    def take_over(self, feeder: Feeder) -> None:
        self.close = self.started = True  # the handler wrote the tunnel's "200 Connection established"
        self._proto.take_over(feeder, self.request)

    async def drained(self) -> None:
        await self._proto._drain_helper()
