"""One tunnel connection as a sans-I/O state machine, from HELLO to CLOSED: messages in, events out,
``data_to_send()`` out.

No asyncio, no sockets, no clock of its own: the caller passes ``now`` (seconds, any monotonic origin) to
:meth:`Connection.receive` and :meth:`Connection.tick`. One object lives through every state of
raven/protocol/state.py's table: born in HANDSHAKE (raven/protocol/handshake.py's :class:`ClientConnection` and
:class:`ServerConnection` add each side's half of HELLO/WELCOME), OPEN on the numbers both sides agreed, then
DRAINING, ENDED, CLOSED. It holds the stream table, stream ids, per-stream flow accounts, the heartbeat deadlines
and the outgoing frames; raven/transport/ runs it over a WebSocket, tests drive two of them in memory.

One stream's halves, transition table and flow accounts are in raven/protocol/stream.py; here they are kept in
a table, moved by frames in and calls out, and leave it when both halves are DONE or reset (ids are never reused).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

from raven.protocol import terms, wire
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
from raven.protocol.flow import VoidAllowance
from raven.protocol.outbox import Outbox
from raven.protocol.state import LIVE, OVER, SessionEvent, SessionState, next_state
from raven.protocol.stream import Half, Step, StreamReset, StreamState


class Connection:
    """One tunnel connection's protocol state. ``opener``: the gateway's side (opens streams, odd ids).

    It is born in HANDSHAKE; each side's handshake (raven/protocol/handshake.py) moves it to OPEN with the numbers
    both sides agreed (:meth:`_agree`) or ends it. Its life is a :class:`SessionState` moved only through
    raven/protocol/state.py's table.
    """

    __slots__ = (
        "_events", "_greeting", "_last_peer_id", "_next_id", "_next_ping", "_ping_sent", "_ping_seq", "_voids",
        "batched", "close_code", "close_reason", "datagrams_dropped", "ended_from", "heartbeat_interval",
        "heartbeat_timeout", "hello", "last_rx", "limits", "local_max_streams", "local_window", "opener", "out",
        "peer_max_streams", "peer_window", "rtt", "state", "streams", "version"
    )

    BATCH_BUDGET: Final = Outbox.BATCH_BUDGET
    DATAGRAM_QUEUE: Final = Outbox.DATAGRAM_QUEUE
    # Frames that do nothing (empty DATA, frames for streams that ended or never were) cost the receiver work and
    # the sender nothing: a peer may send this many per second after a burst, then the session ends.
    VOID_RATE: Final = 1000.0
    VOID_BURST: Final = 10000.0

    def __init__(self, *, opener: bool, limits: wire.Limits = wire.DEFAULT_LIMITS, now: float = 0.0) -> None:
        self.opener = opener
        self.limits = limits
        self.hello: wire.Hello | None = None  # the agent's HELLO (sent or received) until OPEN, then let go
        self._greeting: list[bytes] | None = None  # the handshake's messages (one frame each, never batched)
        # What the handshake agrees (:meth:`_agree`); nothing flows before it.
        self.version = 0
        self.batched = False
        self.local_window = self.peer_window = 0
        self.local_max_streams = self.peer_max_streams = 0
        self.heartbeat_interval = self.heartbeat_timeout = 0.0
        self.streams: dict[int, StreamState] = {}
        self._next_id = 1 if opener else 2
        self._last_peer_id = 0
        self.out = Outbox(False)
        self.datagrams_dropped = 0
        self._events: list[Event] = []
        self.state = SessionState.HANDSHAKE
        self.ended_from: SessionState | None = None  # the state the protocol ended in (HANDSHAKE, OPEN, DRAINING)
        self.close_reason = ""
        self.close_code = 0
        self.last_rx = now
        self.rtt: float | None = None
        self._ping_seq = 0
        self._ping_sent: tuple[int, float] | None = None
        self._next_ping = now
        self._voids = VoidAllowance(self.VOID_RATE, self.VOID_BURST, now)

    # ------------------------------------------------------------ the handshake's end (each side's half: handshake.py)

    def _agree(self, *, version: int, local_window: int, peer_window: int, local_max_streams: int,
               peer_max_streams: int, heartbeat_interval: float, heartbeat_timeout: float, now: float) -> None:
        """HANDSHAKE -> OPEN on the numbers both sides agreed, the heartbeat counted from ``now``."""
        self._set(SessionEvent.AGREED)
        self.hello = None
        self.version = version
        self.batched = version >= wire.BATCHED_FROM
        self.out = Outbox(self.batched)
        self.local_window, self.peer_window = local_window, peer_window
        self.local_max_streams, self.peer_max_streams = local_max_streams, peer_max_streams
        self.heartbeat_interval, self.heartbeat_timeout = heartbeat_interval, heartbeat_timeout
        self.last_rx = now
        self._next_ping = now + heartbeat_interval
        self._voids = VoidAllowance(self.VOID_RATE, self.VOID_BURST, now)

    def fail(self, reason: str) -> None:
        """The handshake ended without a connection (refused, or broken, ``reason`` says how): HANDSHAKE -> ENDED."""
        if self.state is not SessionState.HANDSHAKE:
            raise LocalProtocolError(f"no handshake to fail: the connection is {self.state.value}")
        self.ended_from = self.state
        self._set(SessionEvent.END)
        self.close_reason = reason

    # ------------------------------------------------------------ the state

    def _set(self, event: SessionEvent) -> None:
        self.state = next_state(self.state, event)

    @property
    def closed(self) -> bool:
        """The protocol is over (ENDED or CLOSED): nothing more is sent or received."""
        return self.state in OVER

    @property
    def peer_draining(self) -> bool:
        """The peer said DRAIN (and the session is DRAINING, or ended while it was)."""
        return SessionState.DRAINING in (self.state, self.ended_from)

    @property
    def usable(self) -> bool:
        """A new stream may be opened here: live, the peer not draining, ids left."""
        return self.state is SessionState.OPEN and self._next_id <= wire.MAX_STREAM_ID

    # ------------------------------------------------------------ queries

    @property
    def in_flight(self) -> int:
        return len(self.streams)

    @property
    def ids_left(self) -> int:
        return max(0, (wire.MAX_STREAM_ID - self._next_id) // 2 + 1)

    def alive(self, stream_id: int) -> bool:
        """Whether the stream is still in the table (not finished both ways, not reset)."""
        return stream_id in self.streams

    def credit(self, stream_id: int) -> int:
        st = self.streams.get(stream_id)
        return st.credit.available if st is not None else 0

    # ------------------------------------------------------------ output

    @property
    def pending_bytes(self) -> int:  # bytes queued and not yet taken by data_to_send
        return self.out.pending_bytes

    def data_to_send(self, budget: int | None = None) -> list[bytes]:
        """What leaves now as WebSocket messages: the handshake's (one frame each), then (one per frame in version
        1, batched from version 2) every control frame, then streams' data in the outbox's order of service up to
        ``budget`` bytes (None: all)."""
        greeting, self._greeting = self._greeting, None  # an idle session keeps no empty list
        out = self.out.take(budget)
        return out if greeting is None else greeting + out

    # ------------------------------------------------------------ local actions

    def open_stream(self, open_frame: wire.Open) -> int:
        """Open a stream (opener side) and queue its OPEN; returns the id. Raises :class:`StreamReset`."""
        if self.state not in LIVE:
            raise StreamReset(wire.ResetCode.SESSION_CLOSED, f"session closed: {self.close_reason}", remote=False)
        if not self.opener:
            raise LocalProtocolError("the accepting side opens no streams")
        if len(self.streams) >= self.peer_max_streams:
            raise StreamReset(wire.ResetCode.LIMIT, f"{len(self.streams)} streams open, agent limit", remote=False)
        stream_id = self._next_id
        if stream_id > wire.MAX_STREAM_ID:
            raise StreamReset(wire.ResetCode.SESSION_CLOSED, "stream ids of this session exhausted", remote=False)
        frame = terms.as_sent(open_frame, stream_id, self.version)  # the request's terms as this version carries them
        self.out.frame(frame)  # encoding raises for unencodable input before anything is registered
        self._next_id += 2
        self.streams[stream_id] = StreamState(
            stream_id, frame, Half.DONE if frame.fin else Half.BODY, Half.HEAD, self.local_window, self.peer_window
        )
        return stream_id

    def _stream(self, stream_id: int) -> StreamState:
        st = self.streams.get(stream_id)
        if st is None:
            raise LocalProtocolError(f"stream {stream_id} is not open")
        return st

    def send_head(self, stream_id: int, status: int, reason: str, headers: wire.Headers, fin: bool = False) -> None:
        """Queue the response head (acceptor side)."""
        st = self._stream(stream_id)
        frame = wire.Head(stream_id, status, reason, headers, fin)
        nxt = st.local_next(Step.HEAD_FIN if fin else Step.HEAD)
        self.out.frame(frame)  # encoding raises for an unencodable head before the state moves
        st.local = nxt
        self._release_if_done(st)

    def send_data(self, stream_id: int, data: bytes | bytearray | memoryview, fin: bool = False) -> int:
        """Queue as much of ``data`` as credit and the frame size allow; returns how many bytes (maybe 0).

        FIN goes on the frame only if all of ``data`` went. The bytes are referenced, not copied, until
        :meth:`data_to_send`; a caller that reuses a mutable buffer must pass a copy.
        """
        st = self._stream(stream_id)
        view = data if isinstance(data, memoryview) else memoryview(data)
        st.local = st.local_next(Step.DATA)  # raises before any credit is taken
        n = st.credit.take(min(len(view), self.limits.max_data))
        last = fin and n == len(view)
        if n == 0 and not last:
            return 0
        if last:
            st.local = st.local_next(Step.FIN)
        self.out.data(stream_id, view[:n] if n < len(view) else view, last)
        if last:
            self._release_if_done(st)
        return n

    def end_stream(self, stream_id: int) -> None:
        """Half-close: this side sends nothing more. Idempotent; a stream no longer open is left alone."""
        st = self.streams.get(stream_id)
        if st is None or st.local is Half.DONE:
            return
        st.local = st.local_next(Step.FIN)
        self.out.after_data(stream_id, wire.End(stream_id))  # behind the stream's queued data
        self._release_if_done(st)

    def reset_stream(self, stream_id: int, code: int, reason: str) -> None:
        """Abort the stream both ways and tell the peer (idempotent; :meth:`_abort_stream` says what leaves)."""
        st = self.streams.pop(stream_id, None)
        if st is not None:
            self._abort_stream(stream_id, st, wire.Reset(stream_id, code, reason))

    def _abort_stream(self, stream_id: int, st: StreamState | None, frame: wire.Reset | None) -> None:
        """A stream aborted here (out of the table): its queued data is dropped, RESET (if any) first, unless its
        FIN is queued too (a complete answer: RESET then only says "stop sending", behind it)."""
        if st is None or st.local is not Half.DONE:
            self.out.drop(stream_id)
        if frame is not None:
            self.out.after_data(stream_id, frame)
        self.out.forget(stream_id)

    def consumed(self, stream_id: int, n: int) -> None:
        """The consumer took ``n`` received bytes: give credit back (in batches of half a window)."""
        st = self.streams.get(stream_id)
        if st is None:
            return
        inc = st.recv.consumed(n)
        if inc and st.remote is not Half.DONE:
            self.out.frame(wire.Window(stream_id, inc))

    def send_datagram(self, packet: bytes | bytearray | memoryview) -> bool:
        """Queue one IP packet (version 2 sessions). False: dropped, the queue is full or the packet too big."""
        if self.state not in LIVE or len(packet) > self.limits.max_data or not self.out.datagram(packet):
            self.datagrams_dropped += 1
            return False
        return True

    def send_control(self, frame: wire.ControlFrame) -> None:
        if self.state in LIVE:
            self.out.frame(frame)

    def close(self, code: int = 0, reason: str = "closed") -> list[Event]:
        """Close (GOAWAY when ``code`` and live); streams still open are aborted, their events returned. During the
        handshake (the local side gives up on it) nothing is sent."""
        if self.state is SessionState.CLOSED:
            return []
        if self.state in LIVE:
            self._end(reason, code, EndCause.CLOSED, goaway=bool(code))
        elif self.state is SessionState.HANDSHAKE:
            self.ended_from, self.close_reason = self.state, reason
        self._set(SessionEvent.CLOSE)
        events, self._events = self._events, []
        return events

    def abort(self, reason: str) -> list[Event]:
        """End the protocol here (a peer that does not read): ENDED, every stream aborted, no GOAWAY. Idempotent."""
        if self.state in OVER:
            return []
        self._end(reason, 0, EndCause.ABORTED, goaway=False)
        events, self._events = self._events, []
        return events

    def _release_if_done(self, st: StreamState) -> None:
        if st.local is Half.DONE and st.remote is Half.DONE:
            del self.streams[st.id]
            self.out.forget(st.id)

    # ------------------------------------------------------------ time

    def next_deadline(self) -> float:
        """When :meth:`tick` has something to do: the next PING or the silence deadline, whichever is first."""
        return min(self._next_ping, self.last_rx + self.heartbeat_timeout)

    def tick(self, now: float) -> list[Event]:
        """Heartbeat: end a session whose peer has been silent too long, else send the PING that is due."""
        if self.state not in LIVE:
            return []
        silent = now - self.last_rx
        if silent >= self.heartbeat_timeout:  # at the deadline (the transport's timer fires there) is too late
            self._end(f"heartbeat timeout: peer silent for {silent:.1f}s", 0, EndCause.HEARTBEAT, goaway=False)
        elif now >= self._next_ping:
            self._ping_seq += 1
            self._ping_sent = (self._ping_seq, now)
            self._next_ping = now + self.heartbeat_interval
            self.out.frame(wire.Ping(self._ping_seq))
        events, self._events = self._events, []
        return events

    # ------------------------------------------------------------ input

    def receive(self, message: bytes | bytearray | memoryview, now: float) -> list[Event]:
        """Handle one received WebSocket message. Never raises for bad input: it becomes RESET or GOAWAY."""
        if self.state not in LIVE:
            if self.state is SessionState.HANDSHAKE:
                raise LocalProtocolError("the handshake is not over: its messages go to the handshake's methods")
            return []
        self.last_rx = now
        events = self._events = []
        if self.batched:
            try:
                frames = wire.split_batch(message, self.limits)
            except wire.ProtocolError as err:
                self._on_error(err)
                self._events = []
                return events
        else:
            frames = [message]  # type: ignore[list-item]
        for raw in frames:
            try:
                frame = wire.decode(raw, self.limits)
                _RECEIVED.get(type(frame), Connection._on_control)(self, frame)
            except wire.ProtocolError as err:
                self._on_error(err)
            if self.closed:
                break
        self._events = []
        return events

    def _on_error(self, err: wire.ProtocolError) -> None:
        self._events.append(ProtocolViolation(err.stream_id, err.reason))
        if err.stream_id == 0:
            self._end(f"protocol error: {err.reason}", wire.ResetCode.PROTOCOL, EndCause.PROTOCOL, goaway=True)
            return
        st = self.streams.pop(err.stream_id, None)
        if st is not None:
            self._events.append(StreamAborted(err.stream_id, err.code, err.reason, False))
            self._events.append(StreamClosed(err.stream_id))
        self._abort_stream(err.stream_id, st, wire.Reset(err.stream_id, err.code, err.reason))
        try:
            self._void()  # each costs a RESET: a peer that provokes them without end is cut off
        except wire.ProtocolError as void:
            self._on_error(void)

    def _end(self, reason: str, code: int, cause: EndCause, goaway: bool) -> None:
        self.ended_from = self.state
        self._set(SessionEvent.END)
        self.close_reason = reason
        self.close_code = code
        self.out.drop_datagrams()
        if goaway:
            self.out.frame(wire.GoAway(code, reason))
        events = self._events
        for sid, st in self.streams.items():  # GOAWAY says RESET for each; their stale data does not hold it up
            self._abort_stream(sid, st, None)
            events += (StreamAborted(sid, wire.ResetCode.SESSION_CLOSED, f"session closed: {reason}", False),
                       StreamClosed(sid))
        self.streams.clear()
        events.append(SessionEnded(reason, code, cause))

    def _closed_by_peer(self, st: StreamState) -> None:
        if st.local is Half.DONE and st.remote is Half.DONE:
            del self.streams[st.id]
            self.out.forget(st.id)
            self._events.append(StreamClosed(st.id))

    # ------------------------------------------------------------ received frames, one handler per type (_RECEIVED)

    def _on_data(self, frame: wire.Data) -> None:
        st = self._stream_for(frame.stream_id)
        if st is None:
            return
        st.remote_step(Step.DATA)
        data = frame.data if isinstance(frame.data, memoryview) else memoryview(frame.data)
        if data:
            st.recv.received(len(data), st.id)
        elif not frame.fin:
            self._void()
        if frame.fin:
            st.remote_step(Step.FIN)
        self._events.append(DataReceived(st.id, data, frame.fin))
        if frame.fin:
            self._closed_by_peer(st)

    def _on_window(self, frame: wire.Window) -> None:
        st = self._stream_for(frame.stream_id)
        if st is not None and st.local is not Half.DONE:
            st.credit.grant(frame.increment, st.id)
            self._events.append(CreditReceived(st.id))

    def _on_head(self, frame: wire.Head) -> None:
        st = self._stream_for(frame.stream_id)
        if st is None:
            return
        if not self._is_own_id(st.id):
            raise wire.ProtocolError("HEAD on a stream the peer opened", st.id)
        st.remote_step(Step.HEAD_FIN if frame.fin else Step.HEAD)
        self._events.append(HeadReceived(st.id, frame))
        if frame.fin:
            self._events.append(DataReceived(st.id, memoryview(b""), True))
            self._closed_by_peer(st)

    def _on_end(self, frame: wire.End) -> None:
        st = self._stream_for(frame.stream_id)
        if st is None:
            return
        st.remote_step(Step.FIN)
        self._events.append(DataReceived(st.id, memoryview(b""), True))
        self._closed_by_peer(st)

    def _on_reset(self, frame: wire.Reset) -> None:
        if self.streams.pop(frame.stream_id, None) is not None:
            self.out.drop(frame.stream_id)  # the peer discards it
            self._events.append(StreamAborted(frame.stream_id, frame.code, frame.reason, True))
            self._events.append(StreamClosed(frame.stream_id))

    def _on_datagram(self, frame: wire.Datagram) -> None:
        packet = frame.packet if isinstance(frame.packet, memoryview) else memoryview(frame.packet)
        self._events.append(DatagramReceived(packet))

    def _on_ping(self, frame: wire.Ping) -> None:
        self.out.frame(wire.Pong(frame.opaque))

    def _on_pong(self, frame: wire.Pong) -> None:
        sent = self._ping_sent
        if sent is not None and sent[0] == frame.opaque:
            self.rtt = self.last_rx - sent[1]  # last_rx: receive()'s now
            self._ping_sent = None

    def _on_goaway(self, frame: wire.GoAway) -> None:
        self._end(f"peer said goodbye: {frame.reason}", 0, EndCause.GOAWAY, goaway=False)

    def _on_drain(self, frame: wire.Drain) -> None:
        self._set(SessionEvent.PEER_DRAIN)
        self._events.append(ControlReceived(frame))

    def _on_control(self, frame: wire.ControlFrame) -> None:
        """Any other frame is the service's (raven/protocol/control.py dispatches it)."""
        self._events.append(ControlReceived(frame))

    def _is_own_id(self, stream_id: int) -> bool:
        return (stream_id % 2 == 1) == self.opener

    def _void(self) -> None:
        self._voids.spend(self.last_rx)  # last_rx: the caller's now for every message received

    def _stream_for(self, stream_id: int) -> StreamState | None:
        st = self.streams.get(stream_id)
        if st is not None:
            return st
        # A frame for a stream that already ended (it raced with our RESET or END) is dropped (and counted as
        # doing nothing); a frame for a stream that never existed is a protocol error (counted in _on_error).
        known = stream_id < self._next_id if self._is_own_id(stream_id) else stream_id <= self._last_peer_id
        if not known:
            raise wire.ProtocolError(f"frame for unknown stream {stream_id}", stream_id)
        self._void()
        return None

    def _on_open(self, frame: wire.Open) -> None:
        sid = frame.stream_id
        if self.opener or self._is_own_id(sid):
            raise wire.ProtocolError("this side does not accept streams", sid, wire.ResetCode.REFUSED)
        if sid <= self._last_peer_id:
            raise wire.ProtocolError(f"OPEN reuses stream id {sid}")
        self._last_peer_id = sid
        terms.check_version(frame, self.version)
        if len(self.streams) >= self.local_max_streams:
            self.out.frame(wire.Reset(sid, wire.ResetCode.LIMIT, f"agent stream limit {self.local_max_streams}"))
            return
        self.streams[sid] = StreamState(
            sid, frame, Half.HEAD, Half.DONE if frame.fin else Half.BODY, self.local_window, self.peer_window
        )
        self._events.append(StreamOpened(sid, frame))


# A received frame's handler by its type (wire.decode returns exactly these classes); any other type is a
# control frame for the service.
_RECEIVED: Final[dict[type[Any], Callable[[Connection, Any], None]]] = {
    wire.Data: Connection._on_data, wire.Window: Connection._on_window, wire.Head: Connection._on_head,
    wire.End: Connection._on_end, wire.Reset: Connection._on_reset, wire.Open: Connection._on_open,
    wire.Datagram: Connection._on_datagram, wire.Ping: Connection._on_ping, wire.Pong: Connection._on_pong,
    wire.GoAway: Connection._on_goaway, wire.Drain: Connection._on_drain,
}
