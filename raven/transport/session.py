"""The asyncio side of a tunnel session: the sans-I/O core (raven.protocol.session) run over a message transport.

One reader (:meth:`Session.run`) feeds every received message to the core and turns its events into woken
waiters; it never awaits a stream's consumer, so one slow stream cannot stall the others. One writer task sends
everything the core has queued as few messages as the protocol version allows, once per turn of the loop, and
waits on the transport's own flow control (the sink's ``send`` drains); stream writers wait only when more than
``HIGH_WATER`` bytes are queued. The writer exists while there is output or a stream is open, so an idle session
holds no task. The heartbeat is driven by one timer per loop (raven.transport.heartbeat).

The streams' awaitables are raven/transport/stream.py.

Size: the session's reader, writer, event dispatch, close and heartbeat share its state (the core, the writer
task, the waiters); split, they would reach into each other.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Protocol

from raven.lograte import RateLimitedLog
from raven.protocol import session as core
from raven.protocol import wire
from raven.protocol.events import (
    ControlReceived,
    CreditReceived,
    DatagramReceived,
    DataReceived,
    Event,
    HeadReceived,
    ProtocolViolation,
    SessionEnded,
    StreamAborted,
    StreamClosed,
    StreamOpened,
)
from raven.protocol.handshake import Agreement
from raven.protocol.session import StreamReset
from raven.transport.heartbeat import Heartbeats
from raven.transport.stream import Stream

__all__ = ["MessageSink", "Session", "Stream", "StreamReset"]

log = logging.getLogger("raven.session")
# What a peer can trigger frame after frame (bad frames, frames for unknown streams) is logged at most once a
# minute per session and kind, with a count of what was left out.
_peer_log = RateLimitedLog(log)

class MessageSink(Protocol):
    """Where a session's messages go (one WebSocket, in production)."""

    async def send(self, message: bytes) -> None: ...

    async def close(self) -> None: ...


OpenHandler = Callable[[Stream], None]
ControlHandler = Callable[[wire.ControlFrame], None]


class Session:
    """One tunnel connection carrying many streams, over a :class:`MessageSink`.

    ``opener`` is True on the gateway side, which opens streams (odd ids); the agent accepts them. Parameters
    come from the HELLO/WELCOME exchange (raven.protocol.handshake) done by the caller; ``version`` is the one
    agreed there (version 2 batches frames into messages).
    """

    __slots__ = (
        "__weakref__",
        "_closed",
        "_closed_fut",
        "_in_transit",
        "_out_waiter",
        "_over_limit",
        "_room_waiters",
        "_send_since",
        "_tasks",
        "_writer_task",
        "core",
        "heartbeat_interval",
        "loop",
        "name",
        "on_closing",
        "on_control",
        "on_datagram",
        "on_open",
        "on_stream_closed",
        "sink",
        "streams",
    )

    HIGH_WATER = 1 << 20  # bytes queued for the transport before stream writers wait
    LOW_WATER = 256 * 1024
    HARD_LIMIT = 16 << 20  # frames that do not wait (opens, heads, replies) beyond this: the peer is not reading
    WRITE_STALL_TIMEOUTS = 3  # a write waiting this many heartbeat timeouts for the peer to read ends the session

    def __init__(
        self,
        sink: MessageSink,
        *,
        opener: bool,
        name: str,
        local_window: int,
        peer_window: int,
        local_max_streams: int,
        peer_max_streams: int,
        limits: wire.Limits = wire.DEFAULT_LIMITS,
        version: int = wire.PROTOCOL_VERSION,
        on_open: OpenHandler | None = None,
        on_control: ControlHandler | None = None,
        on_stream_closed: Callable[[Stream], None] | None = None,
    ) -> None:
        self.loop = asyncio.get_running_loop()
        self.sink = sink
        self.name = name
        self.core = core.Session(
            opener=opener,
            local_window=local_window,
            peer_window=peer_window,
            local_max_streams=local_max_streams,
            peer_max_streams=peer_max_streams,
            limits=limits,
            version=version,
            now=self.loop.time(),
        )
        self.on_open = on_open
        self.on_control = on_control
        self.on_datagram: Callable[[memoryview], None] | None = None
        self.on_closing: Callable[[], None] | None = None  # told at once when the session starts to close
        self.on_stream_closed = on_stream_closed
        self.streams: dict[int, Stream] = {}
        self._writer_task: asyncio.Task[None] | None = None
        self._out_waiter: asyncio.Future[None] | None = None
        self._in_transit = 0  # bytes the writer took from the core and has not finished sending
        self._over_limit = False
        self._send_since: float | None = None  # when the send in progress began (a stalled peer is cut off)
        self._room_waiters: list[asyncio.Future[None]] = []
        self._closed = False
        self._closed_fut: asyncio.Future[None] = self.loop.create_future()  # lighter than an Event
        self._tasks: list[asyncio.Task[None]] = []
        self.heartbeat_interval = self.core.heartbeat_interval

    @classmethod
    def after_handshake(
        cls,
        sink: MessageSink,
        agreed: Agreement,
        *,
        opener: bool,
        name: str,
        limits: wire.Limits,
        on_open: OpenHandler | None = None,
        on_control: ControlHandler | None = None,
        on_stream_closed: Callable[[Stream], None] | None = None,
    ) -> Session:
        """The session either side builds from the handshake's agreement, heartbeat started."""
        session = cls(
            sink,
            opener=opener,
            name=name,
            local_window=agreed.local_window,
            peer_window=agreed.peer_window,
            local_max_streams=agreed.local_max_streams,
            peer_max_streams=agreed.peer_max_streams,
            limits=limits,
            version=agreed.version,
            on_open=on_open,
            on_control=on_control,
            on_stream_closed=on_stream_closed,
        )
        session.start(agreed.heartbeat_interval, agreed.heartbeat_timeout)
        return session

    # ------------------------------------------------------------ the core's state, read through

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def close_reason(self) -> str:
        return self.core.close_reason

    @property
    def opener(self) -> bool:
        return self.core.opener

    @property
    def peer_draining(self) -> bool:
        return self.core.peer_draining

    @property
    def rtt(self) -> float | None:
        return self.core.rtt

    @property
    def last_rx(self) -> float:
        return self.core.last_rx

    @property
    def in_flight(self) -> int:
        return len(self.streams)

    @property
    def ids_left(self) -> int:
        return self.core.ids_left

    @property
    def _queued(self) -> int:
        return self.core.pending_bytes + self._in_transit

    # ------------------------------------------------------------ lifecycle

    def start(self, heartbeat_interval: float, heartbeat_timeout: float) -> None:
        self.heartbeat_interval = heartbeat_interval
        self.core.set_heartbeat(heartbeat_interval, heartbeat_timeout, self.loop.time())
        Heartbeats.of(self.loop).add(self)

    async def run(self, messages: AsyncIterator[bytes]) -> None:
        """Feed every received message until the transport ends, then close."""
        reason = "peer closed the connection"
        try:
            async for message in messages:
                self.feed(message)
                if self._closed or self.core.closed:
                    return
        except (ConnectionError, asyncio.IncompleteReadError) as exc:
            reason = f"connection lost: {exc}"
        finally:
            await self.close(self.core.close_reason or reason, self.core.close_code)

    def feed(self, message: bytes | bytearray | memoryview) -> None:
        """Handle one received message. Never blocks and never raises for bad input."""
        if self._closed:
            return
        events = self.core.receive(message, self.loop.time())
        if events:
            self._handle(events)
        self._kick()

    def tick(self, now: float) -> None:
        """Called by :class:`Heartbeats`: close a silent session, or one whose peer has read nothing for the
        heartbeat timeout (it may still send, so the silence check alone would not see it), or send the PING."""
        since = self._send_since
        deadline = self.WRITE_STALL_TIMEOUTS * self.core.heartbeat_timeout
        if since is not None and now - since > deadline and not self._closed:
            log.warning("session %s: a write has waited %.1fs for the peer to read (deadline %.1fs): closing",
                        self.name, now - since, deadline)
            self._close_soon(f"peer not reading: a write stalled for {now - since:.1f}s")
            return
        events = self.core.tick(now)
        if events:
            self._handle(events)
        self._kick()

    async def close(self, reason: str, code: int = 0) -> None:
        """End the session: every stream is reset, tasks stop, the transport closes. Idempotent."""
        if self._closed:
            await self.wait_closed()
            return
        self._closed = True
        if self.on_closing is not None:
            # Before the transport's close (up to seconds): layer 3 promotes another agent at once.
            with contextlib.suppress(Exception):
                self.on_closing()
        self._handle(self.core.close(code, reason))
        for stream in list(self.streams.values()):  # a stream the core had already let go
            stream._on_reset(StreamReset(wire.ResetCode.SESSION_CLOSED, f"session closed: {reason}", remote=False))
            self._release(stream)
        current = asyncio.current_task()
        if self._writer_task is not None and self._writer_task is not current:
            self._tasks.append(self._writer_task)
        for task in self._tasks:
            if task is not current:
                task.cancel()
        for fut in self._room_waiters:
            if not fut.done():
                fut.set_result(None)
        last = self.core.data_to_send()  # frames queued before the end, then GOAWAY when there is one
        if last and code:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(1.0):
                    for message in last:
                        await self.sink.send(message)
        with contextlib.suppress(Exception):
            async with asyncio.timeout(2.0):
                await self.sink.close()
        for task in self._tasks:
            if task is not current:
                with contextlib.suppress(BaseException):
                    await task
        if not self._closed_fut.done():
            self._closed_fut.set_result(None)

    async def wait_closed(self) -> None:
        """Wait until :meth:`close` has finished (a cancelled waiter leaves the session alone)."""
        await asyncio.shield(self._closed_fut)

    def _close_soon(self, reason: str, code: int = 0) -> None:
        if not self._closed:
            self._tasks.append(self.loop.create_task(self.close(reason, code)))

    # ------------------------------------------------------------ events from the core

    def _handle(self, events: list[Event]) -> None:
        streams = self.streams
        for ev in events:
            if isinstance(ev, DataReceived):
                stream = streams.get(ev.stream_id)
                if stream is not None:
                    stream._on_data(ev.data, ev.fin)
            elif isinstance(ev, CreditReceived):
                stream = streams.get(ev.stream_id)
                if stream is not None:
                    Stream._wake(stream._credit_waiter)
            elif isinstance(ev, HeadReceived):
                stream = streams.get(ev.stream_id)
                if stream is not None:
                    stream._on_head(ev.head)
            elif isinstance(ev, StreamClosed):
                stream = streams.get(ev.stream_id)
                if stream is not None:
                    self._release(stream)
            elif isinstance(ev, StreamOpened):
                stream = Stream(self, ev.stream_id, ev.open)
                streams[ev.stream_id] = stream
                if self.on_open is not None:
                    self.on_open(stream)
            elif isinstance(ev, StreamAborted):
                stream = streams.get(ev.stream_id)
                if stream is not None:
                    stream._on_reset(StreamReset(ev.code, ev.reason, remote=ev.remote))
            elif isinstance(ev, DatagramReceived):
                if self.on_datagram is not None:
                    self.on_datagram(ev.packet)
            elif isinstance(ev, ControlReceived):
                if self.on_control is not None:
                    self.on_control(ev.frame)
            elif isinstance(ev, ProtocolViolation):
                if ev.stream_id == 0:
                    _peer_log.warning(self.name, "protocol", "session %s: protocol error: %s", self.name, ev.reason)
                else:
                    _peer_log.info(self.name, "stream-error", "session %s: stream %d: %s", self.name, ev.stream_id,
                                   ev.reason)
            elif isinstance(ev, SessionEnded):
                if ev.reason.startswith("heartbeat timeout"):
                    log.warning("session %s: %s (deadline %.1fs): closing", self.name, ev.reason,
                                self.core.heartbeat_timeout)
                self._close_soon(ev.reason, ev.code)

    # ------------------------------------------------------------ streams

    def open_stream(self, open_frame: wire.Open) -> Stream:
        """Open a stream (opener side): the OPEN frame is queued at once. Raises :class:`StreamReset`."""
        if self._closed:
            raise StreamReset(wire.ResetCode.SESSION_CLOSED, f"session closed: {self.close_reason}", remote=False)
        try:
            stream_id = self.core.open_stream(open_frame)
        except StreamReset as err:
            if "exhausted" in err.reason:
                # Ids are never reused: end this session; the agent redials and gets a fresh one.
                self._close_soon("stream ids exhausted: reconnect for a new session", wire.ResetCode.LIMIT)
            raise
        stream = Stream(self, stream_id, self.core.streams[stream_id].open)
        self.streams[stream_id] = stream
        self._kick()
        return stream

    def _release_if_done(self, stream: Stream) -> None:
        if not self.core.alive(stream.id):
            self._release(stream)

    def _release(self, stream: Stream) -> None:
        if not stream._finished.done():
            stream._finished.set_result(None)
        if self.streams.pop(stream.id, None) is not None and self.on_stream_closed is not None:
            self.on_stream_closed(stream)

    def send_control(self, frame: wire.ControlFrame) -> None:
        self.core.send_control(frame)
        self._kick()

    def send_datagram(self, packet: bytes | memoryview) -> bool:
        """One IP packet (layer 3); False if it was dropped (queue full, too big, session closed or version 1)."""
        if self._closed or not self.core.send_datagram(packet):
            return False
        self._kick()
        return True

    @property
    def carries_datagrams(self) -> bool:
        return self.core.batched and not self._closed

    # ------------------------------------------------------------ sending

    def _kick(self) -> None:
        """Output is queued in the core: make sure the writer will send it (on the next turn of the loop)."""
        pending = self.core.pending_bytes
        if not pending or self._closed:
            return
        if pending + self._in_transit > self.HARD_LIMIT:
            if not self._over_limit:  # once: every later kick until the close would log and spawn again
                self._over_limit = True
                log.warning("session %s: %d bytes queued and the peer is not reading them: closing", self.name,
                            pending + self._in_transit)
                self._close_soon(f"peer not reading: over {self.HARD_LIMIT} bytes queued")
            return
        if self._writer_task is None:
            self._writer_task = self.loop.create_task(self._writer())
        else:
            waiter = self._out_waiter
            if waiter is not None and not waiter.done():
                waiter.set_result(None)

    async def _wait_send_room(self) -> None:
        while self._queued > self.HIGH_WATER and not self._closed:
            fut = self.loop.create_future()
            self._room_waiters.append(fut)
            await fut
        if self._closed:
            raise StreamReset(wire.ResetCode.SESSION_CLOSED, f"session closed: {self.close_reason}", remote=False)

    async def _writer(self) -> None:
        core_session = self.core
        try:
            while not self._closed:
                messages = core_session.data_to_send()
                if not messages:
                    if not self.streams:
                        return  # idle: no task held (memory); the next output starts a new writer
                    self._out_waiter = self.loop.create_future()
                    try:
                        await self._out_waiter
                    finally:
                        self._out_waiter = None
                    continue
                for message in messages:
                    self._in_transit += len(message)
                for message in messages:
                    self._send_since = self.loop.time()
                    await self.sink.send(message)
                    self._send_since = None
                    self._in_transit -= len(message)
                if self._room_waiters and self._queued <= self.LOW_WATER:
                    waiters, self._room_waiters = self._room_waiters, []
                    for fut in waiters:
                        if not fut.done():
                            fut.set_result(None)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._close_soon(f"send failed: {exc!r}")
        finally:
            self._writer_task = None
