"""The tunnel: the asyncio side of one session, a ready sans-I/O core (raven.protocol.connection) run over a
message transport.

The split is websockets' ``protocol.py`` beside ``asyncio/connection.py``: the core holds every rule and the
session's state (raven/protocol/state.py); this layer only moves bytes and wakes waiters. One reader
(:meth:`Tunnel.run`) feeds every received message to the core and turns its events into woken waiters through a
table (event type -> handler); it never awaits a stream's consumer, so one slow stream cannot stall the others.
One writer task sends what the core has queued, taking over a TCP socket only what the kernel may hold unsent
(raven/transport/pacer.py): the backlog stays in the core, whose outbox orders it as it leaves (small streams
before bulk ones). Stream writers wait over ``HIGH_WATER`` bytes queued, a stream with none queued only over twice
that. The writer exists while there is output or a stream is open, so an idle session holds no task. The
heartbeat is one timer at the core's ``next_deadline()``.

Tunnels are made by raven/transport/connect.py (``connect()`` for the agent, ``accept()`` for the gateway) from
the handshake's core; the streams' awaitables are raven/transport/stream.py, which reach the tunnel only through
its :class:`raven.transport.stream.Link` methods.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, Final, Protocol

from raven.lograte import RateLimitedLog
from raven.protocol import connection as core
from raven.protocol import wire
from raven.protocol.errors import LocalProtocolError
from raven.protocol.events import (
    ControlReceived,
    CreditReceived,
    DatagramReceived,
    DataReceived,
    EndCause,
    Event,
    HeadReceived,
    ProtocolViolation,
    SessionEnded,
    StreamAborted,
    StreamClosed,
    StreamOpened,
)
from raven.protocol.state import LIVE, SessionState
from raven.protocol.stream import StreamReset
from raven.transport.pacer import Pacer
from raven.transport.stream import Stream

__all__ = ["MessageSink", "Stream", "StreamReset", "Tunnel"]

log = logging.getLogger("raven.session")
# What a peer can trigger frame after frame (bad frames, frames for unknown streams) is logged at most once a
# minute per session and kind, with a count of what was left out.
_peer_log = RateLimitedLog(log)


class MessageSink(Protocol):
    """Where a session's messages go (one WebSocket, in production)."""

    async def send(self, message: bytes) -> None: ...

    async def send_many(self, messages: list[bytes]) -> None: ...  # all of them in this turn of the loop

    async def close(self) -> None: ...


OpenHandler = Callable[[Stream], None]
ControlHandler = Callable[[wire.ControlFrame], None]


class Tunnel:
    """One tunnel connection carrying many streams, over a :class:`MessageSink`, around a ready ``core``.

    The core is the connection whose handshake raven/transport/connect.py ran (raven/protocol/handshake.py), or
    in tests one after a handshake in memory; ``core.opener`` is True on the gateway side, which opens streams.
    """

    __slots__ = (
        "__weakref__", "_closed_fut", "_in_transit", "_out_waiter", "_pacer", "_room_waiters", "_send_since",
        "_tasks", "_timer", "_timer_at", "_writer_task", "core", "loop", "name", "on_closing", "on_control",
        "on_datagram", "on_open", "on_stream_closed", "sink", "streams",
    )

    HIGH_WATER: Final = 1 << 20  # bytes queued for the transport before stream writers wait
    LOW_WATER: Final = 256 * 1024
    HARD_LIMIT: Final = 16 << 20  # frames that do not wait (opens, heads, replies) beyond this: the peer is not reading
    WRITE_STALL_TIMEOUTS: Final = 3  # a write waiting this many heartbeat timeouts for the reader ends the session
    MIN_BUDGET: Final = 4096  # bytes taken from the core per send at the least (the kernel's room may be less)
    FRAMING_OVERHEAD: Final = 40  # bytes the kernel gets per message beyond it: a WebSocket header (2-14), TLS (22+)
    MIN_TIMER_STEP: Final = 0.01  # seconds: a deadline already reached is looked at again no sooner than this

    def __init__(
        self,
        sink: MessageSink,
        session_core: core.Connection,
        *,
        name: str,
        on_open: OpenHandler | None = None,
        on_control: ControlHandler | None = None,
        on_stream_closed: Callable[[Stream], None] | None = None,
        sock: Any = None,
    ) -> None:
        if session_core.state not in LIVE:
            raise LocalProtocolError(f"a transport session needs an open core, not {session_core.state.value}")
        self.loop = asyncio.get_running_loop()
        self.sink = sink
        self.name = name
        self.core = session_core
        self.on_open = on_open
        self.on_control = on_control
        self.on_datagram: Callable[[memoryview], None] | None = None
        self.on_closing: Callable[[], None] | None = None  # told at once when the session starts to close
        self.on_stream_closed = on_stream_closed
        self.streams: dict[int, Stream] = {}
        self._writer_task: asyncio.Task[None] | None = None
        self._out_waiter: asyncio.Future[None] | None = None
        self._in_transit = 0  # bytes the writer took from the core and has not finished sending
        self._send_since: float | None = None  # when the send in progress began (a stalled peer is cut off)
        self._room_waiters: list[tuple[int, asyncio.Future[None]]] | None = None  # writers waiting for room, if any
        self._pacer = Pacer.of(sock, self.loop)  # ``sock``: the transport's TCP socket, if it has one
        self._closed_fut: asyncio.Future[None] | None = None  # made by close() or by a wait for it
        self._tasks: list[asyncio.Task[None]] | None = None  # close() in a task of its own, then the writer
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0

    # ------------------------------------------------------------ what the services read (derived from the core)

    @property
    def state(self) -> SessionState:
        return self.core.state

    @property
    def closed(self) -> bool:
        """The session is over (ENDED or CLOSED): it sends and receives nothing more."""
        return self.core.closed

    @property
    def usable(self) -> bool:
        """A new stream may go here: OPEN (the peer is not draining), stream ids left."""
        return self.core.usable

    @property
    def close_reason(self) -> str:
        return self.core.close_reason

    @property
    def in_flight(self) -> int:
        return len(self.streams)

    @property
    def carries_datagrams(self) -> bool:
        return self.core.batched and self.core.state in LIVE

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start the heartbeat (at the core's next deadline). :meth:`run` does it; idempotent."""
        if self._timer is None and self.core.state in LIVE:
            self._arm()

    async def run(self, messages: AsyncIterator[bytes]) -> None:
        """Feed every received message until the transport ends, then close."""
        self.start()
        reason = "peer closed the connection"
        try:
            async for message in messages:
                self.feed(message)
                if self.core.closed:
                    return
        except (ConnectionError, asyncio.IncompleteReadError) as exc:
            reason = f"connection lost: {exc}"
        finally:
            await self.close(self.core.close_reason or reason, self.core.close_code)

    def feed(self, message: bytes | bytearray | memoryview) -> None:
        """Handle one received message. Never blocks and never raises for bad input."""
        events = self.core.receive(message, self.loop.time())
        if events:
            self._handle(events)
        self._kick()

    def _arm(self) -> None:
        now = self.loop.time()
        when = self.core.next_deadline()
        if when <= now:
            when = now + self.MIN_TIMER_STEP
        self._timer_at = when
        self._timer = self.loop.call_at(when, self._on_deadline)

    def _on_deadline(self) -> None:
        """The core's deadline: close a silent session, or one whose peer has read nothing for a while (it may
        still send, so the silence check alone would not see it), or send the PING that is due."""
        self._timer = None
        now = max(self.loop.time(), self._timer_at)  # the loop may run a timer a clock tick early
        since = self._send_since
        deadline = self.WRITE_STALL_TIMEOUTS * self.core.heartbeat_timeout
        if since is not None and now - since > deadline and not self.core.closed:
            log.warning("session %s: a write has waited %.1fs for the peer to read (deadline %.1fs): closing",
                        self.name, now - since, deadline)
            self._abort(f"peer not reading: a write stalled for {now - since:.1f}s")
            return
        events = self.core.tick(now)
        if events:
            self._handle(events)
        self._kick()
        if self.core.state in LIVE:
            self._arm()

    def _abort(self, reason: str) -> None:
        """End the protocol now (every stream reset at once); the transport closes on the next turn."""
        self._handle(self.core.abort(reason))

    async def close(self, reason: str, code: int = 0) -> None:
        """End the session: every stream is reset, tasks stop, the transport closes. Idempotent."""
        if self.core.state is SessionState.CLOSED:
            await self.wait_closed()
            return
        events = self.core.close(code, reason)  # CLOSED from here: a second close() waits for this one
        if self.on_closing is not None:
            # Before the transport's close (up to seconds): layer 3 promotes another agent at once.
            with contextlib.suppress(Exception):
                self.on_closing()
        self._handle(events)
        reason = self.core.close_reason or reason
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._pacer is not None:
            self._pacer.close()  # before the transport's close: its duplicate descriptor would keep the socket
        for stream in list(self.streams.values()):  # a stream the core had already let go
            stream.aborted(StreamReset(wire.ResetCode.SESSION_CLOSED, f"session closed: {reason}", remote=False))
            self._release(stream)
        current = asyncio.current_task()
        tasks = [t for t in (*(self._tasks or ()), self._writer_task) if t is not None and t is not current]
        for task in tasks:
            task.cancel()
        for _, fut in self._room_waiters or ():
            if not fut.done():
                fut.set_result(None)
        last = self.core.data_to_send()  # frames queued before the end, then GOAWAY when there is one
        if last and self.core.close_code:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(1.0):
                    for message in last:
                        await self.sink.send(message)
        with contextlib.suppress(Exception):
            async with asyncio.timeout(2.0):
                await self.sink.close()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task
        self._closed_fut = self._closed_fut or self.loop.create_future()
        if not self._closed_fut.done():
            self._closed_fut.set_result(None)

    async def wait_closed(self) -> None:
        """Wait until :meth:`close` has finished (a cancelled waiter leaves the session alone)."""
        if self._closed_fut is None:
            self._closed_fut = self.loop.create_future()  # lighter than an Event, and only once someone waits
        await asyncio.shield(self._closed_fut)

    def _close_soon(self, reason: str, code: int = 0) -> None:
        if self.core.state is not SessionState.CLOSED:
            self._tasks = [*(self._tasks or ()), self.loop.create_task(self.close(reason, code))]

    # ------------------------------------------------------------ events from the core, through a table

    def _handle(self, events: list[Event]) -> None:
        table = _ON_EVENT
        for ev in events:
            table[type(ev)](self, ev)

    def _on_data(self, ev: DataReceived) -> None:
        stream = self.streams.get(ev.stream_id)
        if stream is not None:
            stream.data_received(ev.data, ev.fin)

    def _on_credit(self, ev: CreditReceived) -> None:
        stream = self.streams.get(ev.stream_id)
        if stream is not None:
            stream.credit_received()

    def _on_head(self, ev: HeadReceived) -> None:
        stream = self.streams.get(ev.stream_id)
        if stream is not None:
            stream.head_received(ev.head)

    def _on_stream_closed(self, ev: StreamClosed) -> None:
        stream = self.streams.get(ev.stream_id)
        if stream is not None:
            self._release(stream)

    def _on_stream_opened(self, ev: StreamOpened) -> None:
        stream = Stream(self, ev.stream_id, ev.open, opener=False)
        self.streams[ev.stream_id] = stream
        if self.on_open is not None:
            self.on_open(stream)

    def _on_aborted(self, ev: StreamAborted) -> None:
        stream = self.streams.get(ev.stream_id)
        if stream is not None:
            stream.aborted(StreamReset(ev.code, ev.reason, remote=ev.remote))

    def _on_datagram(self, ev: DatagramReceived) -> None:
        if self.on_datagram is not None:
            self.on_datagram(ev.packet)

    def _on_control(self, ev: ControlReceived) -> None:
        if self.on_control is not None:
            self.on_control(ev.frame)

    def _on_violation(self, ev: ProtocolViolation) -> None:
        if ev.stream_id == 0:
            _peer_log.warning(self.name, "protocol", "session %s: protocol error: %s", self.name, ev.reason)
        else:
            _peer_log.info(self.name, "stream-error", "session %s: stream %d: %s", self.name, ev.stream_id,
                           ev.reason)

    def _on_ended(self, ev: SessionEnded) -> None:
        if ev.cause is EndCause.HEARTBEAT:
            log.warning("session %s: %s (deadline %.1fs): closing", self.name, ev.reason, self.core.heartbeat_timeout)
        self._close_soon(ev.reason, ev.code)

    # ------------------------------------------------------------ streams

    def open_stream(self, open_frame: wire.Open) -> Stream:
        """Open a stream (opener side): the OPEN frame is queued at once. Raises :class:`StreamReset`."""
        session_core = self.core
        try:
            stream_id = session_core.open_stream(open_frame)
        except StreamReset:
            if session_core.state in LIVE and session_core.ids_left == 0:
                # Ids are never reused: end this session; the agent redials and gets a fresh one.
                self._close_soon("stream ids exhausted: reconnect for a new session", wire.ResetCode.LIMIT)
            raise
        stream = Stream(self, stream_id, session_core.streams[stream_id].open, opener=True)
        self.streams[stream_id] = stream
        self._kick()
        return stream

    def _release(self, stream: Stream) -> None:
        stream.released()
        if self.streams.pop(stream.id, None) is not None and self.on_stream_closed is not None:
            self.on_stream_closed(stream)

    # The Link surface (raven/transport/stream.py): what a stream asks of its session.

    def congested(self, stream_id: int) -> bool:
        """Over ``HIGH_WATER`` queued; a stream with nothing queued may still add up to twice that."""
        queued = self.core.pending_bytes + self._in_transit
        return queued > self.HIGH_WATER and (queued > 2 * self.HIGH_WATER or self.core.out.queued(stream_id) > 0)

    async def wait_send_room(self, stream_id: int) -> None:
        while self.congested(stream_id) and self.core.state in LIVE:
            fut = self.loop.create_future()
            if self._room_waiters is None:
                self._room_waiters = []
            self._room_waiters.append((stream_id, fut))  # in place: no copy of the list at each wait
            await fut
        if self.core.state not in LIVE:
            raise StreamReset(wire.ResetCode.SESSION_CLOSED, f"session closed: {self.close_reason}", remote=False)

    def consumed(self, stream_id: int, n: int) -> None:
        self.core.consumed(stream_id, n)
        self._kick()

    def send_data(self, stream_id: int, data: memoryview, fin: bool) -> int:
        n = self.core.send_data(stream_id, data, fin)
        if n:
            self._kick()
        return n

    def send_head(self, stream: Stream, status: int, reason: str, headers: wire.Headers, fin: bool) -> None:
        self.core.send_head(stream.id, status, reason, headers, fin)
        self._kick()

    def end_stream(self, stream: Stream) -> None:
        self.core.end_stream(stream.id)
        self._kick()
        self.done_writing(stream)

    def reset_stream(self, stream: Stream, code: wire.ResetCode, reason: str) -> None:
        self.core.reset_stream(stream.id, code, reason)
        self._kick()
        stream.aborted(StreamReset(code, reason, remote=False))
        self._release(stream)

    def done_writing(self, stream: Stream) -> None:
        """The stream sent its last frame: let it go if the peer's side had ended too."""
        if not self.core.alive(stream.id):
            self._release(stream)

    # ------------------------------------------------------------ control frames and packets

    def send_control(self, frame: wire.ControlFrame) -> None:
        self.core.send_control(frame)
        self._kick()

    def send_datagram(self, packet: bytes | memoryview) -> bool:
        """One IP packet (layer 3); False if it was dropped (queue full, too big, session closed or version 1)."""
        if not self.core.send_datagram(packet):
            return False
        self._kick()
        return True

    # ------------------------------------------------------------ sending

    def _kick(self) -> None:
        """Output is queued in the core: make sure the writer will send it (on the next turn of the loop)."""
        session_core = self.core
        pending = session_core.pending_bytes
        if not pending or session_core.state not in LIVE:
            return
        if pending + self._in_transit > self.HARD_LIMIT:
            log.warning("session %s: %d bytes queued and the peer is not reading them: closing", self.name,
                        pending + self._in_transit)
            self._abort(f"peer not reading: over {self.HARD_LIMIT} bytes queued")
            return
        if self._writer_task is None:
            self._writer_task = self.loop.create_task(self._writer())
        else:
            waiter = self._out_waiter
            if waiter is not None and not waiter.done():
                waiter.set_result(None)

    async def _writer(self) -> None:
        session_core = self.core
        pacer = self._pacer
        waited = False
        try:
            while session_core.state in LIVE:
                budget = None
                if pacer is not None and session_core.pending_bytes:
                    room = pacer.room(session_core.pending_bytes)
                    if room <= 0 and not waited:  # the kernel holds enough: the rest waits here, in order
                        waited = True
                        self._send_since = self.loop.time()
                        await pacer.writable()
                        self._send_since = None
                        continue
                    budget = max(room, self.MIN_BUDGET)
                waited = False
                messages = session_core.data_to_send(budget)
                if not messages:
                    if not self.streams:
                        return  # idle: no task held (memory); the next output starts a new writer
                    self._out_waiter = self.loop.create_future()
                    try:
                        await self._out_waiter
                    finally:
                        self._out_waiter = None
                    continue
                size = 0
                for message in messages:
                    size += len(message)
                self._in_transit += size
                if pacer is not None:  # each message's WebSocket header and TLS record overhead counted too
                    pacer.spent(size + self.FRAMING_OVERHEAD * len(messages))
                self._send_since = self.loop.time()
                await self.sink.send_many(messages)  # one wake-up of the writer, one await
                self._send_since = None
                self._in_transit -= size
                if self._room_waiters:
                    self._wake_writers()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._close_soon(f"send failed: {exc!r}")
        finally:
            self._writer_task = None

    def _wake_writers(self) -> None:
        """Stream writers waiting for room: all of them below ``LOW_WATER``, else those that may add now."""
        low = self.core.pending_bytes + self._in_transit <= self.LOW_WATER
        waiting: list[tuple[int, asyncio.Future[None]]] = []
        for sid, fut in self._room_waiters or ():
            if fut.done():
                continue
            if low or not self.congested(sid):
                fut.set_result(None)
            else:
                waiting.append((sid, fut))
        self._room_waiters = waiting or None


# Each event of the core and the session's handler for it.
_ON_EVENT: Final[dict[type[Event], Callable[[Tunnel, Any], None]]] = {
    DataReceived: Tunnel._on_data,
    CreditReceived: Tunnel._on_credit,
    HeadReceived: Tunnel._on_head,
    StreamClosed: Tunnel._on_stream_closed,
    StreamOpened: Tunnel._on_stream_opened,
    StreamAborted: Tunnel._on_aborted,
    DatagramReceived: Tunnel._on_datagram,
    ControlReceived: Tunnel._on_control,
    ProtocolViolation: Tunnel._on_violation,
    SessionEnded: Tunnel._on_ended,
}
