"""A tunnel's WebSocket after the HTTP Upgrade: the core's RFC 6455 codec (raven/protocol/wsframe.py) on the
connection's own bytes, in place of aiohttp's WebSocket reader and writer (raven/transport/wsupgrade.py hands the
connection over; aiohttp still does the Upgrade itself on both sides).

What it saves per message, against aiohttp's reader and writer: no message object, no queue and no task woken per
message (received messages go straight to the session's ``feed`` from ``data_received``), and the frames of
all the messages a writer's wake-up sends written in that one turn of the loop (``send_many``).

:class:`WsLink` is three things for one connection: the parser aiohttp's protocol feeds (``feed_data``,
``feed_eof``), the session's sink (``send``, ``send_many``, ``close``) and, until the session is served, a source
of single messages for the handshake (``receive``). Received messages wait in a bounded inbox until
:meth:`serve` attaches the session; over ``INBOX_LIMIT`` bytes reading pauses. Pings are answered with pongs;
while the peer is not reading (the transport's writing is paused) only the latest ping's pong is held (RFC 6455
section 5.5.3 allows it) and reading pauses until the peer reads again (at most ``drain_timeout``: then the
connection is cut), so a peer that sends pings and reads nothing cannot grow our write buffer; a close frame
is answered and ends the connection; a frame the codec refuses is answered with a close frame carrying its code
and reason and ends the connection with that reason. A write waits while the transport's
buffer is over its high-water mark (the peer is slow), at most ``drain_timeout``: then the connection is cut.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from typing import Any, Final, Protocol

from raven.lograte import RateLimitedLog
from raven.protocol import wsframe
from raven.protocol.wsframe import Close, FrameDecoder, FrameEncoder, Masker, Ping, WebSocketError
from raven.transport.websocket import TransportError

log = logging.getLogger("raven.session")
_peer_log = RateLimitedLog(log)


class Session(Protocol):
    """What a link feeds (raven/transport/tunnel.py's Tunnel)."""

    name: str

    @property
    def closed(self) -> bool: ...

    @property
    def close_reason(self) -> str: ...

    def start(self) -> None: ...

    def feed(self, message: bytes | bytearray | memoryview) -> None: ...

    async def close(self, reason: str, code: int = 0) -> None: ...


class DrainHost(Protocol):
    """aiohttp's protocol under the connection (its BaseProtocol): told by the transport when writing pauses."""

    @property
    def writing_paused(self) -> bool: ...

    async def _drain_helper(self) -> None: ...


class WsLink:
    """One upgraded connection's WebSocket framing (see the module's docstring)."""

    __slots__ = (
        "__weakref__", "_decoder", "_encoder", "_gone", "_gone_waiter", "_held_pong", "_inbox", "_inbox_bytes",
        "_paused", "_peer_closed", "_pong_wait", "_reason", "_receiver", "_sent_close", "_session", "_waiter",
        "drain_timeout", "name", "protocol", "transport",
    )

    INBOX_LIMIT: Final = 1 << 20  # bytes received before the session is served; reading pauses over it
    CLOSE_TIMEOUT: Final = 1.5  # seconds a close waits for the peer's close frame (Tunnel.close allows 2)

    def __init__(self, protocol: DrainHost, transport: asyncio.Transport, *, client: bool, max_message: int,
                 masker: Masker = wsframe.mask_python, drain_timeout: float = 60.0) -> None:
        self.protocol = protocol
        self.transport = transport
        self.name = "websocket"
        self.drain_timeout = drain_timeout
        self._decoder = FrameDecoder(client=client, max_message=max_message, masker=masker)
        self._encoder = FrameEncoder(client=client, masker=masker)
        self._session: Session | None = None
        self._inbox: deque[bytes | bytearray] | None = None  # made at the first message, dropped once empty
        self._inbox_bytes = 0
        self._paused = False  # reading paused for the inbox
        self._held_pong: bytes | None = None  # the latest ping's payload, while the peer is not reading
        self._pong_wait: asyncio.Task[None] | None = None  # waits for the peer to read; reading paused meanwhile
        self._receiver: asyncio.Future[None] | None = None
        # Why the link ended (the session ends with it); None while it runs. An idle session holds no future for
        # it: only serve() waits for the end, on a future of its own (memory per idle session).
        self._reason: str | None = None
        self._waiter: asyncio.Future[None] | None = None  # serve()'s wait for the end
        self._gone = False  # the peer's close frame came, or the connection went
        self._gone_waiter: asyncio.Future[None] | None = None  # made by a close() that waits for it
        self._sent_close = False
        self._peer_closed = False

    # ------------------------------------------------------------ aiohttp's parser interface

    def feed_data(self, data: bytes | bytearray | memoryview) -> tuple[bool, bytes]:
        """Bytes from the connection (aiohttp's ``data_received``). Never raises."""
        if self._reason is not None:
            return False, b""
        try:
            events = self._decoder.receive(data if isinstance(data, (bytes, bytearray)) else bytes(data))
        except WebSocketError as err:
            _peer_log.warning(self.name, "websocket", "session %s: websocket protocol error from the peer: %s "
                              "(closing with %d)", self.name, err.reason, err.code)
            self._fail(err.code, f"websocket protocol error from the peer: {err.reason}")
            return False, b""
        session = self._session
        for ev in events:
            if isinstance(ev, (bytes, bytearray)):
                if session is not None:
                    try:
                        session.feed(ev)
                    except Exception as exc:  # a bug, never the peer's input: the session ends, the loop goes on
                        log.exception("session %s: feeding a message failed", self.name)
                        self._fail(wsframe.CLOSE_INTERNAL_ERROR, f"internal error: {exc!r}")
                        return False, b""
                    if session.closed:
                        self._end(session.close_reason or "session closed")
                        return False, b""
                else:
                    self._queue(ev)
            elif isinstance(ev, Ping):
                self._pong(ev.payload)
            elif isinstance(ev, Close):
                self._on_close(ev)
                return False, b""
        return False, b""

    def feed_eof(self) -> None:
        """The connection is gone (aiohttp's ``connection_lost``)."""
        self._end("connection lost" if not self._peer_closed else "peer closed the connection")
        if self._pong_wait is not None:
            self._pong_wait.cancel()
        self._set_gone()
        self._wake_receiver()

    # ------------------------------------------------------------ received messages

    def _queue(self, message: bytes | bytearray) -> None:
        if self._inbox is None:
            self._inbox = deque()
        self._inbox.append(message)
        self._inbox_bytes += len(message)
        if self._inbox_bytes > self.INBOX_LIMIT and not self._paused:
            self._paused = True
            with contextlib.suppress(Exception):
                self.transport.pause_reading()
        self._wake_receiver()

    def _wake_receiver(self) -> None:
        fut = self._receiver
        if fut is not None and not fut.done():
            fut.set_result(None)

    def _take(self) -> bytes | bytearray:
        """The oldest waiting message (the inbox is not empty); an emptied inbox is let go (a deque is 760 bytes
        an idle session would keep)."""
        inbox = self._inbox
        if inbox is None:
            raise LookupError("no message waiting")  # never: callers look first
        message = inbox.popleft()
        if not inbox:
            self._inbox = None
        self._inbox_bytes -= len(message)
        if self._paused and self._inbox_bytes <= self.INBOX_LIMIT // 2:
            self._paused = False
            if self._pong_wait is None:
                with contextlib.suppress(Exception):
                    self.transport.resume_reading()
        return message

    async def receive(self) -> bytes:
        """The next binary message (the handshake's); :class:`TransportError` once the connection has ended."""
        while self._inbox is None:
            if self._reason is not None:
                raise TransportError(f"websocket closed: {self._reason}")
            self._receiver = asyncio.get_running_loop().create_future()
            try:
                await self._receiver
            finally:
                self._receiver = None
        return bytes(self._take())

    async def serve(self, session: Session) -> None:
        """Feed ``session`` every message (those waiting first) until the connection ends, then close it, as
        ``Tunnel.run`` does over an iterator of messages."""
        self.name = session.name
        session.start()
        try:
            while self._inbox is not None and not session.closed:
                session.feed(self._take())
            if not session.closed and self._reason is None:
                self._session = session
                # Not shielded: this future is serve()'s own (a shield costs a future, two closures and their
                # cells per idle session); a cancel of serve() ends the wait, never the link.
                self._waiter = asyncio.get_running_loop().create_future()
                await self._waiter
        finally:
            self._session = None
            self._waiter = None
            await session.close(session.close_reason or self._reason or "the tunnel handler ended")

    # ------------------------------------------------------------ pings

    def _pong(self, payload: bytes) -> None:
        """Answer a ping at once, unless the peer is not reading what we write: then hold only the latest ping's
        answer and stop reading until the peer reads (as aiohttp's autoping awaited its drain)."""
        if self._pong_wait is None and not self.protocol.writing_paused:
            self._write(self._encoder.pong(payload))
            return
        self._held_pong = payload
        if self._pong_wait is None and not self.transport.is_closing():
            with contextlib.suppress(Exception):
                self.transport.pause_reading()
            self._pong_wait = asyncio.get_running_loop().create_task(self._pong_when_drained())

    async def _pong_when_drained(self) -> None:
        """Wait (at most ``drain_timeout``) for the peer to read, then send the held pong and read again."""
        # The drain's waiter is shared with the session's writer: shielded, so that this wait's end never cancels it.
        drained = asyncio.ensure_future(self.protocol._drain_helper())
        drained.add_done_callback(_retrieved)
        try:
            async with asyncio.timeout(self.drain_timeout):
                await asyncio.shield(drained)
        except TimeoutError:
            reason = f"peer not reading: a pong waited {self.drain_timeout:.1f}s"
            _peer_log.warning(self.name, "pong", "session %s: %s (closing)", self.name, reason)
            self._end(reason)
            self.transport.abort()
            return
        except ConnectionError:  # the connection went: feed_eof ends the link
            return
        finally:
            self._pong_wait = None
        payload, self._held_pong = self._held_pong, None
        if payload is not None:
            self._write(self._encoder.pong(payload))
        if not self._paused and not self.transport.is_closing():
            with contextlib.suppress(Exception):
                self.transport.resume_reading()

    # ------------------------------------------------------------ the connection's end

    def _end(self, reason: str) -> None:
        if self._reason is None:
            self._reason = reason
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        self._wake_receiver()

    def _set_gone(self) -> None:
        self._gone = True
        waiter = self._gone_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _on_close(self, ev: Close) -> None:
        self._peer_closed = True
        why = f"peer closed the websocket ({ev.code or 1005}{': ' + ev.reason[:200] if ev.reason else ''})"
        self._end(why)
        self._set_gone()
        if not self._sent_close:  # the peer began: answer with its code, then the connection closes
            self._sent_close = True
            self._write(self._encoder.close(ev.code or wsframe.CLOSE_NORMAL))
        self._close_transport()

    def _fail(self, code: int, reason: str) -> None:
        self._end(reason)
        if not self._sent_close:
            self._sent_close = True
            self._write(self._encoder.close(code, reason))
        self._close_transport()

    def _close_transport(self) -> None:
        """Close once what is buffered has left; at once (abort) when the peer is not reading it."""
        transport = self.transport
        if transport.is_closing():
            return
        if self.protocol.writing_paused:
            transport.abort()
        else:
            transport.close()

    # ------------------------------------------------------------ sending (the session's sink)

    def _write(self, data: bytes | bytearray) -> None:
        if not self.transport.is_closing():
            self.transport.write(data)

    async def send(self, message: bytes) -> None:
        await self.send_many([message])

    async def send_many(self, messages: list[bytes]) -> None:
        """Every message as one binary frame, each written as soon as it is made (uvloop sends one turn's writes
        with one system call; joining them, or making them all first, held every frame's buffer at once and
        measured dearer), then wait (at most ``drain_timeout``) while the transport holds more than its
        high-water mark."""
        if self._sent_close or self.transport.is_closing():
            raise TransportError(f"websocket closed: {self._reason or 'closing'}")
        write = self.transport.write
        frame = self._encoder.frame
        for message in messages:
            write(frame(wsframe.OP_BINARY, message))  # one frame's buffer alive at a time
        if self.protocol.writing_paused:
            await self._drain()

    async def _drain(self) -> None:
        try:
            async with asyncio.timeout(self.drain_timeout):
                await self.protocol._drain_helper()
        except TimeoutError:
            reason = f"peer not reading: a write waited {self.drain_timeout:.1f}s"
            self._end(reason)
            self.transport.abort()
            raise TransportError(reason) from None

    async def close(self, code: int = wsframe.CLOSE_NORMAL, reason: str = "") -> None:
        """The close handshake: send a close frame, wait for the peer's (at most ``CLOSE_TIMEOUT``), close the
        connection (at once if the peer does not answer or does not read, or the wait is cancelled). Idempotent."""
        try:
            if not self._sent_close and not self.transport.is_closing():
                self._sent_close = True
                self.transport.write(self._encoder.close(code, reason))
            if not self._peer_closed and not self._gone and not self.transport.is_closing():
                if self._gone_waiter is None:
                    self._gone_waiter = asyncio.get_running_loop().create_future()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.CLOSE_TIMEOUT):
                        await asyncio.shield(self._gone_waiter)  # shared by every close() that waits
        finally:
            self._end("closed by this side")
            if not self.transport.is_closing():
                if self._peer_closed:
                    self._close_transport()
                else:
                    self.transport.abort()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self.transport.get_extra_info(name, default)


def _retrieved(fut: asyncio.Future[None]) -> None:
    """A shielded drain wait's outcome, taken so that a lost connection's error is not logged as unretrieved."""
    if not fut.cancelled():
        fut.exception()
