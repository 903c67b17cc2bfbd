"""The asyncio stream multiplexer: sessions, streams, flow control and heartbeat.

A :class:`Session` sits on a message transport (one WebSocket) and carries many
:class:`Stream` objects. Its read side (:meth:`Session.feed`) never awaits: data is
queued on the stream it belongs to, bounded by that stream's receive window, so one
slow consumer cannot stall the others. All outgoing frames go through one writer task,
which keeps frames in order and applies backpressure from the socket.

Size: the session and its streams are one state machine interleaved with asyncio here; issue 11 replaces
it by a sans-I/O core (raven/protocol/) under a thin asyncio layer, which splits it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
from collections.abc import AsyncIterator, Callable
from typing import Protocol

from raven.errors import RavenError
from raven.lograte import RateLimitedLog
from raven.protocol import wire
from raven.protocol.flow import RecvWindow, SendCredit

log = logging.getLogger("raven.mux")
# What a peer can trigger frame after frame (bad frames, frames for unknown streams) is logged at most once a
# minute per session and kind, with a count of what was left out.
_peer_log = RateLimitedLog(log)

_EMPTY = b""


class MessageSink(Protocol):
    """Where a session's encoded frames go (one WebSocket, in production)."""

    async def send(self, message: bytes) -> None: ...

    async def close(self) -> None: ...


class StreamReset(RavenError):
    """The stream was reset, by the peer or locally. ``code`` is a :class:`wire.ResetCode`."""

    def __init__(self, code: int, reason: str, *, remote: bool) -> None:
        super().__init__(f"{_code_name(code)}: {reason}")
        self.code = code
        self.reason = reason
        self.remote = remote


class SessionClosed(RavenError):
    pass


def _code_name(code: int) -> str:
    try:
        return wire.ResetCode(code).name
    except ValueError:
        return f"code {code}"


class Stream:
    """One request or connection inside a session."""

    __slots__ = (
        "_chunks",
        "_credit",
        "_credit_waiter",
        "_data_waiter",
        "_finished",
        "_head",
        "_recv",
        "_remote_fin",
        "_reset",
        "_session",
        "bytes_in",
        "bytes_out",
        "id",
        "local_fin",
        "open",
    )

    def __init__(self, session: Session, stream_id: int, open_frame: wire.Open) -> None:
        self._session = session
        self.id = stream_id
        self.open = open_frame
        self._recv = RecvWindow(session.local_window)
        self._credit = SendCredit(session.peer_window)
        self._chunks: collections.deque[bytes | memoryview] = collections.deque()
        self._data_waiter: asyncio.Future[None] | None = None
        self._credit_waiter: asyncio.Future[None] | None = None
        self._head: asyncio.Future[wire.Head] = session.loop.create_future()
        self._finished: asyncio.Future[None] = session.loop.create_future()
        self._remote_fin = False
        self.local_fin = False
        self._reset: StreamReset | None = None
        self.bytes_in = 0
        self.bytes_out = 0

    # ------------------------------------------------------------ state

    @property
    def finished(self) -> bool:
        return self._reset is not None or (self.local_fin and self._remote_fin)

    @property
    def reset_error(self) -> StreamReset | None:
        return self._reset

    def _maybe_release(self) -> None:
        if self.finished:
            self._session._release(self)

    @staticmethod
    def _wake(fut: asyncio.Future[None] | None) -> None:
        if fut is not None and not fut.done():
            fut.set_result(None)

    # ------------------------------------------------------------ called by the session's read side

    def _on_head(self, head: wire.Head) -> None:
        if self._head.done():
            raise wire.ProtocolError("second HEAD on stream", self.id)
        self._head.set_result(head)
        if head.fin:
            self._on_fin()

    def _on_data(self, data: memoryview, fin: bool) -> None:
        if self._remote_fin:
            raise wire.ProtocolError("DATA after END", self.id)
        if self._session.opener and not self._head.done():
            raise wire.ProtocolError("DATA before HEAD", self.id)
        n = len(data)
        if n:
            self._recv.received(n, self.id)
            self._chunks.append(data)
            self.bytes_in += n
        if fin:
            self._remote_fin = True
        self._wake(self._data_waiter)
        if fin:
            self._maybe_release()

    def _on_fin(self) -> None:
        if self._remote_fin:
            raise wire.ProtocolError("END after END", self.id)
        if self._session.opener and not self._head.done():
            raise wire.ProtocolError("END before HEAD", self.id)
        self._remote_fin = True
        self._wake(self._data_waiter)
        self._maybe_release()

    def _on_window(self, increment: int) -> None:
        self._credit.grant(increment, self.id)
        self._wake(self._credit_waiter)

    def _on_reset(self, err: StreamReset) -> None:
        if self._reset is not None:
            return
        self._reset = err
        self._chunks.clear()
        if not self._head.done():
            self._head.set_exception(err)
            self._head.exception()  # mark retrieved: nobody may be waiting for a head
        self._wake(self._data_waiter)
        self._wake(self._credit_waiter)
        self._session._release(self)

    # ------------------------------------------------------------ public API

    async def wait_finished(self) -> None:
        """Until the stream has ended both ways or was reset (by either side)."""
        await asyncio.shield(self._finished)

    async def head(self) -> wire.Head:
        """Wait for the response head (opener side). Raises :class:`StreamReset`."""
        return await asyncio.shield(self._head)

    async def read(self) -> bytes | memoryview:
        """Next chunk of data, or ``b""`` at end of stream. Raises :class:`StreamReset`."""
        while True:
            if self._chunks:
                chunk = self._chunks.popleft()
                inc = self._recv.consumed(len(chunk))
                if inc and not self._remote_fin and self._reset is None:
                    self._session._enqueue(wire.encode(wire.Window(self.id, inc)))
                return chunk
            if self._reset is not None:
                raise self._reset
            if self._remote_fin:
                return _EMPTY
            self._data_waiter = self._session.loop.create_future()
            try:
                await self._data_waiter
            finally:
                self._data_waiter = None

    async def write(self, data: bytes | memoryview, end: bool = False) -> None:
        """Send data, waiting for credit and for room in the session's send queue.

        ``end``: this is the last data; the final DATA frame carries FIN, which saves an END frame.
        """
        if self.local_fin:
            raise RuntimeError("write after end")
        view = memoryview(data)
        if end and not view:
            self.end()
            return
        max_data = self._session.limits.max_data
        while view:
            if self._reset is not None:
                raise self._reset
            n = self._credit.take(min(len(view), max_data))
            if n == 0:
                self._credit_waiter = self._session.loop.create_future()
                try:
                    await self._credit_waiter
                finally:
                    self._credit_waiter = None
                continue
            await self._session._wait_send_room()
            if self._reset is not None:
                raise self._reset
            last = end and n == len(view)
            if last:
                self.local_fin = True
            self._session._enqueue(wire.encode_data(self.id, view[:n], last))
            self.bytes_out += n
            view = view[n:]
        if end:
            self._maybe_release()

    def end(self) -> None:
        """Half-close: no more data from this side. Idempotent."""
        if self.local_fin or self._reset is not None:
            return
        self.local_fin = True
        self._session._enqueue(wire.encode(wire.End(self.id)))
        self._maybe_release()

    def send_head(self, status: int, reason: str, headers: wire.Headers, fin: bool = False) -> None:
        """Send the response head (acceptor side)."""
        if self._reset is not None:
            raise self._reset
        if fin:
            self.local_fin = True
        self._session._enqueue(wire.encode(wire.Head(self.id, status, reason, headers, fin)))
        if fin:
            self._maybe_release()

    def reset(self, code: wire.ResetCode, reason: str) -> None:
        """Abort the stream in both directions and tell the peer. Idempotent."""
        if self.finished:
            return
        self._session._enqueue(wire.encode(wire.Reset(self.id, code, reason)))
        self._on_reset(StreamReset(code, reason, remote=False))

    def close(self) -> None:
        """Ensure the stream is finished: a stream not cleanly ended both ways is cancelled."""
        if not self.finished:
            self.reset(wire.ResetCode.CANCEL, "closed by the local side")


OpenHandler = Callable[[Stream], None]
ControlHandler = Callable[[wire.ControlFrame], None]


class Session:
    """One tunnel connection carrying many streams.

    ``opener`` is True on the gateway side, which opens streams (odd ids); the agent
    accepts them. Parameters come from the HELLO/WELCOME exchange done by the caller.
    """

    __slots__ = (
        "__weakref__",
        "_closed",
        "_closed_fut",
        "_direct_sends",
        "_last_peer_id",
        "_last_traffic",
        "_next_id",
        "_out",
        "_out_bytes",
        "_out_waiter",
        "_ping_sent",
        "_ping_seq",
        "_room_waiters",
        "_tasks",
        "_writer_retire",
        "_writer_task",
        "close_reason",
        "heartbeat_interval",
        "heartbeat_timeout",
        "last_rx",
        "limits",
        "local_max_streams",
        "local_window",
        "loop",
        "name",
        "on_control",
        "on_open",
        "on_stream_closed",
        "opener",
        "peer_draining",
        "peer_max_streams",
        "peer_window",
        "rtt",
        "sink",
        "streams",
    )

    HIGH_WATER = 1 << 20  # bytes queued for the socket before writers wait
    LOW_WATER = 256 * 1024
    HARD_LIMIT = 16 << 20  # frames that do not wait (opens, heads, replies) beyond this: the peer is not reading
    MAX_DIRECT_SENDS = 4  # PING/PONG sends in flight while the writer is idle; more are dropped

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
        on_open: OpenHandler | None = None,
        on_control: ControlHandler | None = None,
        on_stream_closed: Callable[[Stream], None] | None = None,
    ) -> None:
        self.loop = asyncio.get_running_loop()
        self.sink = sink
        self.name = name
        self.opener = opener
        self.local_window = local_window
        self.peer_window = peer_window
        self.local_max_streams = local_max_streams
        self.peer_max_streams = peer_max_streams
        self.limits = limits
        self.on_open = on_open
        self.on_control = on_control
        self.on_stream_closed = on_stream_closed
        self.streams: dict[int, Stream] = {}
        self._next_id = 1 if opener else 2
        self._last_peer_id = 0
        self._out: collections.deque[bytes] = collections.deque()
        self._out_bytes = 0
        self._writer_task: asyncio.Task[None] | None = None
        self._out_waiter: asyncio.Future[None] | None = None
        self._writer_retire = False
        self._last_traffic = 0.0  # when a frame other than PING/PONG was last queued
        self._direct_sends: set[asyncio.Task[None]] = set()
        self._room_waiters: list[asyncio.Future[None]] = []
        self._closed = False
        self.close_reason = ""
        self._closed_fut: asyncio.Future[None] = self.loop.create_future()  # lighter than an Event
        self.peer_draining = False
        self.last_rx = self.loop.time()
        self.rtt: float | None = None
        self._ping_seq = itertools.count(1)
        self._ping_sent: dict[int, float] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self.heartbeat_interval = 5.0
        self.heartbeat_timeout = 15.0

    # ------------------------------------------------------------ lifecycle

    @property
    def closed(self) -> bool:
        return self._closed

    def start(self, heartbeat_interval: float, heartbeat_timeout: float) -> None:
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_timeout = heartbeat_timeout
        Heartbeats.of(self.loop).add(self)

    async def run(self, messages: AsyncIterator[bytes]) -> None:
        """Feed every received message until the transport ends, then close."""
        reason = "peer closed the connection"
        try:
            async for message in messages:
                self.feed(message)
                if self._closed:
                    return
        except (ConnectionError, asyncio.IncompleteReadError) as exc:
            reason = f"connection lost: {exc}"
        finally:
            await self.close(self.close_reason or reason)

    async def close(self, reason: str, code: int = 0) -> None:
        """End the session: every stream is reset, tasks stop, the transport closes. Idempotent."""
        if self._closed:
            await self.wait_closed()
            return
        self._closed = True
        self.close_reason = reason
        for stream in list(self.streams.values()):
            stream._on_reset(StreamReset(wire.ResetCode.SESSION_CLOSED, f"session closed: {reason}", remote=False))
        current = asyncio.current_task()
        if self._writer_task is not None and self._writer_task is not current:
            self._tasks.append(self._writer_task)
        self._tasks.extend(self._direct_sends)
        for task in self._tasks:
            if task is not current:
                task.cancel()
        for fut in self._room_waiters:
            if not fut.done():
                fut.set_result(None)
        if code:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(1.0):
                    await self.sink.send(wire.encode(wire.GoAway(code, reason)))
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
            task = self.loop.create_task(self.close(reason, code))
            self._tasks.append(task)

    # ------------------------------------------------------------ sending

    def _enqueue(self, message: bytes, heartbeat: bool = False) -> None:
        if self._closed:
            return
        if not heartbeat:
            self._last_traffic = self.loop.time()
        if self._out_bytes + len(message) > self.HARD_LIMIT:
            log.warning("session %s: %d bytes queued and the peer is not reading them: closing", self.name,
                        self._out_bytes)
            self._close_soon(f"peer not reading: over {self.HARD_LIMIT} bytes queued")
            return
        self._out.append(message)
        self._out_bytes += len(message)
        if self._writer_task is None:
            # The writer runs while there is traffic; the heartbeat timer retires it after an idle
            # interval, so an idle session holds no task (memory) and a busy one creates none (speed).
            self._writer_retire = False
            self._writer_task = self.loop.create_task(self._writer())
        else:
            waiter = self._out_waiter
            if waiter is not None and not waiter.done():
                waiter.set_result(None)

    async def _wait_send_room(self) -> None:
        while self._out_bytes > self.HIGH_WATER and not self._closed:
            fut = self.loop.create_future()
            self._room_waiters.append(fut)
            await fut
        if self._closed:
            raise StreamReset(wire.ResetCode.SESSION_CLOSED, f"session closed: {self.close_reason}", remote=False)

    def send_control(self, frame: wire.ControlFrame) -> None:
        self._enqueue(wire.encode(frame))

    async def _writer(self) -> None:
        try:
            while not self._closed:
                if not self._out:
                    if self._writer_retire:
                        return
                    self._out_waiter = self.loop.create_future()
                    try:
                        await self._out_waiter
                    finally:
                        self._out_waiter = None
                    continue
                message = self._out.popleft()
                await self.sink.send(message)
                self._out_bytes -= len(message)
                if self._room_waiters and self._out_bytes <= self.LOW_WATER:
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

    # ------------------------------------------------------------ streams

    @property
    def in_flight(self) -> int:
        return len(self.streams)

    def open_stream(self, open_frame: wire.Open) -> Stream:
        """Open a stream (opener side): the OPEN frame is queued at once."""
        if self._closed:
            raise StreamReset(wire.ResetCode.SESSION_CLOSED, f"session closed: {self.close_reason}", remote=False)
        if len(self.streams) >= self.peer_max_streams:
            raise StreamReset(wire.ResetCode.LIMIT, f"{len(self.streams)} streams open, agent limit", remote=False)
        stream_id = self._next_id
        if stream_id > wire.MAX_STREAM_ID:
            # Ids are never reused: end this session; the agent redials and gets a fresh one.
            self._close_soon("stream ids exhausted: reconnect for a new session", wire.ResetCode.LIMIT)
            raise StreamReset(wire.ResetCode.SESSION_CLOSED, "stream ids of this session exhausted", remote=False)
        frame = wire.Open(
            stream_id,
            open_frame.kind,
            open_frame.node,
            open_frame.port,
            open_frame.method,
            open_frame.target,
            open_frame.headers,
            open_frame.fin,
        )
        encoded = wire.encode(frame)  # may raise for unencodable input: nothing is registered yet
        self._next_id += 2
        stream = Stream(self, stream_id, frame)
        if frame.fin:
            stream.local_fin = True
        self.streams[stream_id] = stream
        self._enqueue(encoded)
        return stream

    @property
    def ids_left(self) -> int:
        return max(0, (wire.MAX_STREAM_ID - self._next_id) // 2 + 1)

    def _release(self, stream: Stream) -> None:
        if not stream._finished.done():
            stream._finished.set_result(None)
        if self.streams.pop(stream.id, None) is not None and self.on_stream_closed is not None:
            self.on_stream_closed(stream)

    def _is_own_id(self, stream_id: int) -> bool:
        return (stream_id % 2 == 1) == self.opener

    # ------------------------------------------------------------ receiving

    def feed(self, message: bytes | bytearray | memoryview) -> None:
        """Handle one received message. Never blocks and never raises for bad input."""
        if self._closed:
            return
        self.last_rx = self.loop.time()
        try:
            frame = wire.decode(message, self.limits)
            self._dispatch(frame)
        except wire.ProtocolError as err:
            if err.stream_id == 0:
                _peer_log.warning(self.name, "protocol", "session %s: protocol error: %s", self.name, err.reason)
                self._close_soon(f"protocol error: {err.reason}", wire.ResetCode.PROTOCOL)
                return
            stream = self.streams.get(err.stream_id)
            _peer_log.info(self.name, "stream-error", "session %s: stream %d: %s", self.name, err.stream_id,
                           err.reason)
            if stream is not None:
                stream.reset(err.code, err.reason)
            else:
                self._enqueue(wire.encode(wire.Reset(err.stream_id, err.code, err.reason)))

    def _dispatch(self, frame: wire.Frame) -> None:
        if isinstance(frame, wire.Data):
            stream = self._stream_for(frame.stream_id)
            if stream is not None:
                data = frame.data if isinstance(frame.data, memoryview) else memoryview(frame.data)
                stream._on_data(data, frame.fin)
        elif isinstance(frame, wire.Window):
            stream = self._stream_for(frame.stream_id)
            if stream is not None:
                stream._on_window(frame.increment)
        elif isinstance(frame, wire.Head):
            stream = self._stream_for(frame.stream_id)
            if stream is not None:
                if not self._is_own_id(frame.stream_id):
                    raise wire.ProtocolError("HEAD on a stream the peer opened", frame.stream_id)
                stream._on_head(frame)
        elif isinstance(frame, wire.End):
            stream = self._stream_for(frame.stream_id)
            if stream is not None:
                stream._on_fin()
        elif isinstance(frame, wire.Reset):
            stream = self.streams.get(frame.stream_id)
            if stream is not None:
                stream._on_reset(StreamReset(frame.code, frame.reason, remote=True))
        elif isinstance(frame, wire.Open):
            self._on_open(frame)
        elif isinstance(frame, wire.Ping):
            self._send_heartbeat(wire.encode(wire.Pong(frame.opaque)))
        elif isinstance(frame, wire.Pong):
            sent = self._ping_sent.pop(frame.opaque, None)
            if sent is not None:
                self.rtt = self.loop.time() - sent
        elif isinstance(frame, wire.GoAway):
            self._close_soon(f"peer said goodbye: {frame.reason}")
        else:
            if isinstance(frame, wire.Drain):
                self.peer_draining = True
            if self.on_control is not None:
                self.on_control(frame)

    def _stream_for(self, stream_id: int) -> Stream | None:
        stream = self.streams.get(stream_id)
        if stream is not None:
            return stream
        # A frame for a stream that already ended (it raced with our RESET or END) is
        # dropped; a frame for a stream that never existed is a protocol error.
        if self._is_own_id(stream_id):
            known = stream_id < self._next_id
        else:
            known = stream_id <= self._last_peer_id
        if not known:
            raise wire.ProtocolError(f"frame for unknown stream {stream_id}", stream_id)
        return None

    def _on_open(self, frame: wire.Open) -> None:
        sid = frame.stream_id
        if self._is_own_id(sid) or self.on_open is None:
            raise wire.ProtocolError("this side does not accept streams", sid, wire.ResetCode.REFUSED)
        if sid <= self._last_peer_id:
            raise wire.ProtocolError(f"OPEN reuses stream id {sid}")
        self._last_peer_id = sid
        if len(self.streams) >= self.local_max_streams:
            self._enqueue(
                wire.encode(wire.Reset(sid, wire.ResetCode.LIMIT, f"agent stream limit {self.local_max_streams}"))
            )
            return
        stream = Stream(self, sid, frame)
        if frame.fin:
            stream._remote_fin = True
        self.streams[sid] = stream
        self.on_open(stream)

    # ------------------------------------------------------------ heartbeat

    def _tick(self, now: float) -> None:
        """Called by :class:`Heartbeats`: close a silent session, or send the next PING."""
        silent = now - self.last_rx
        if silent > self.heartbeat_timeout:
            log.warning("session %s: no frame for %.1fs (deadline %.1fs): closing", self.name, silent,
                        self.heartbeat_timeout)
            self._close_soon(f"heartbeat timeout: peer silent for {silent:.1f}s")
            return
        waiter = self._out_waiter
        if waiter is not None and not waiter.done() and now - self._last_traffic >= self.heartbeat_interval:
            self._writer_retire = True  # idle for an interval: the writer task ends (an idle session has none)
            waiter.set_result(None)
        seq = next(self._ping_seq)
        self._ping_sent = {seq: now}
        self._send_heartbeat(wire.encode(wire.Ping(seq)))

    def _send_heartbeat(self, message: bytes) -> None:
        """PING/PONG: through the writer when it runs (keeps order), else a short-lived send of their own."""
        if self._closed:
            return
        if self._writer_task is not None and not self._writer_retire:
            self._enqueue(message, heartbeat=True)
            return
        if len(self._direct_sends) >= self.MAX_DIRECT_SENDS:
            return  # a peer pinging faster than it reads gets fewer PONGs, not more memory
        task = self.loop.create_task(self._send_direct(message))
        self._direct_sends.add(task)
        task.add_done_callback(self._direct_sends.discard)

    async def _send_direct(self, message: bytes) -> None:
        try:
            await self.sink.send(message)
        except Exception as exc:
            self._close_soon(f"send failed: {exc!r}")


class Heartbeats:
    """One timer per event loop for every session's heartbeat (a task per session costs memory).

    Each session is visited every ``heartbeat_interval`` seconds (checked at a resolution of
    a tenth of the smallest interval in use), so a silent peer is noticed within
    ``heartbeat_timeout`` plus one interval.
    """

    _by_loop: dict[asyncio.AbstractEventLoop, Heartbeats] = {}

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.sessions: dict[Session, float] = {}  # session -> when its next tick is due
        self._task: asyncio.Task[None] | None = None
        self._wake: asyncio.Event = asyncio.Event()

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> Heartbeats:
        hb = cls._by_loop.get(loop)
        if hb is None or hb.loop.is_closed():
            hb = cls._by_loop[loop] = cls(loop)
        return hb

    def add(self, session: Session) -> None:
        self.sessions[session] = self.loop.time() + session.heartbeat_interval
        if self._task is None or self._task.done():
            self._task = self.loop.create_task(self._run(), name="raven-heartbeats")
        self._wake.set()

    async def _run(self) -> None:
        while self.sessions:
            self._wake.clear()
            step = min(s.heartbeat_interval for s in self.sessions) / 10
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(step):
                    await self._wake.wait()
            now = self.loop.time()
            for session, due in list(self.sessions.items()):
                if session.closed:
                    del self.sessions[session]
                elif now >= due:
                    self.sessions[session] = now + session.heartbeat_interval
                    session._tick(now)
        self._by_loop.pop(self.loop, None)
