"""Property tests of the sans-I/O session: two cores driven against each other, no sockets, no asyncio.

Hypothesis picks arbitrary interleavings of opens, heads, data, window updates (by consuming), ends, resets,
heartbeats and partial deliveries in either direction, and the invariants are checked after every step: windows
never negative, nothing buffered beyond a window, every stream closed exactly once on each side (and, once all is
delivered and both sides let go, on both), no exception but the protocol's own, bounded output.
"""

from __future__ import annotations

import collections

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from raven.protocol import wire
from raven.protocol.connection import Connection
from raven.protocol.errors import LocalProtocolError
from raven.protocol.events import DataReceived, HeadReceived, SessionEnded, StreamClosed, StreamOpened
from raven.protocol.stream import Half, StreamReset
from tests.support.memsession import core_pair

WINDOW = 4096
MAX_STREAMS = 8


class Side:
    """One end: its core, what it has buffered per stream, and every close it has seen."""

    def __init__(self, core: Connection) -> None:
        self.core = core
        self.buffered: dict[int, int] = collections.defaultdict(int)
        self.closes: collections.Counter[int] = collections.Counter()
        self.seen: set[int] = set()  # every stream this side has had in its table
        self.heads: set[int] = set()
        self.ended = False

    def local(self, sid: int, action: object) -> None:
        """Run a local action; a stream it takes out of the table counts as closed here."""
        was = self.core.alive(sid)
        try:
            action()  # type: ignore[operator]
        except LocalProtocolError:
            pass  # the harness may ask for something the state does not allow: refused, state unchanged
        if was and not self.core.alive(sid):
            self.closes[sid] += 1
            self.buffered.pop(sid, None)

    def absorb(self, events: list[object]) -> None:
        for ev in events:
            if isinstance(ev, StreamOpened):
                self.seen.add(ev.stream_id)
            elif isinstance(ev, HeadReceived):
                assert ev.stream_id not in self.heads, "two heads delivered"
                self.heads.add(ev.stream_id)
            elif isinstance(ev, DataReceived):
                self.buffered[ev.stream_id] += len(ev.data)
            elif isinstance(ev, StreamClosed):
                self.closes[ev.stream_id] += 1
                self.buffered.pop(ev.stream_id, None)
            elif isinstance(ev, SessionEnded):
                self.ended = True


class TwoSessions(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.version = 2
        gw, ag = core_pair(WINDOW, MAX_STREAMS, version=self.version, heartbeat=(1.0, 3.0),
                           limits=wire.Limits(max_data=1500))
        self.gw, self.ag = Side(gw), Side(ag)
        self.wire: dict[bool, collections.deque[bytes]] = {True: collections.deque(), False: collections.deque()}
        self.now = 0.0
        self.budget: int | None = None  # what the link takes per flush (None: everything queued)

    # ------------------------------------------------------------ helpers

    def side(self, gw: bool) -> Side:
        return self.gw if gw else self.ag

    def flush(self, gw: bool) -> None:
        self.wire[gw].extend(self.side(gw).core.data_to_send(self.budget))

    def open_ids(self, gw: bool) -> list[int]:
        return sorted(self.side(gw).core.streams)

    # ------------------------------------------------------------ rules

    @rule(budget=st.one_of(st.none(), st.integers(1, 20_000)))
    def link(self, budget: int | None) -> None:
        """The link takes ``budget`` bytes per flush from now on: the rest waits in the outbox, in its order."""
        self.budget = budget

    @rule(fin=st.booleans())
    def open(self, fin: bool) -> None:
        try:
            sid = self.gw.core.open_stream(wire.Open(0, wire.StreamKind.HTTP, "edge-1", 9400, "GET", "/m", (), fin))
        except StreamReset:
            return
        self.gw.seen.add(sid)
        self.flush(True)

    @rule(pick=st.integers(0, 7), fin=st.booleans(), status=st.sampled_from([200, 404, 503]))
    def head(self, pick: int, fin: bool, status: int) -> None:
        ids = self.open_ids(False)
        if ids:
            sid = ids[pick % len(ids)]
            self.ag.local(sid, lambda: self.ag.core.send_head(sid, status, "", (("a", "b"),), fin))
            self.flush(False)

    @rule(gw=st.booleans(), pick=st.integers(0, 7), size=st.integers(0, 5000), fin=st.booleans())
    def data(self, gw: bool, pick: int, size: int, fin: bool) -> None:
        s = self.side(gw)
        ids = self.open_ids(gw)
        if ids:
            sid = ids[pick % len(ids)]
            before = s.core.credit(sid)
            holder: list[int] = []
            s.local(sid, lambda: holder.append(s.core.send_data(sid, b"x" * size, fin)))
            if holder:
                assert holder[0] <= min(before, 1500)
            self.flush(gw)

    @rule(gw=st.booleans(), pick=st.integers(0, 7))
    def end(self, gw: bool, pick: int) -> None:
        s = self.side(gw)
        ids = self.open_ids(gw)
        if ids:
            sid = ids[pick % len(ids)]
            s.local(sid, lambda: s.core.end_stream(sid))
            self.flush(gw)

    @rule(gw=st.booleans(), pick=st.integers(0, 7))
    def reset(self, gw: bool, pick: int) -> None:
        s = self.side(gw)
        ids = self.open_ids(gw)
        if ids:
            sid = ids[pick % len(ids)]
            s.local(sid, lambda: s.core.reset_stream(sid, wire.ResetCode.CANCEL, "test"))
            self.flush(gw)

    @rule(gw=st.booleans(), pick=st.integers(0, 7), n=st.integers(1, 5000))
    def consume(self, gw: bool, pick: int, n: int) -> None:
        s = self.side(gw)
        ids = [sid for sid, b in s.buffered.items() if b and s.core.alive(sid)]
        if ids:
            sid = ids[pick % len(ids)]
            take = min(n, s.buffered[sid])
            s.buffered[sid] -= take
            s.core.consumed(sid, take)
            self.flush(gw)

    @rule(gw=st.booleans(), count=st.integers(1, 4))
    def deliver(self, gw: bool, count: int) -> None:
        """Messages from ``gw``'s side reach the other side, in order."""
        queue = self.wire[gw]
        other = self.side(not gw)
        for _ in range(min(count, len(queue))):
            other.absorb(other.core.receive(queue.popleft(), self.now))  # type: ignore[arg-type]
        self.flush(not gw)

    @rule(dt=st.floats(0.0, 1.5))
    def time_passes(self, dt: float) -> None:
        self.now += dt
        for gw in (True, False):
            s = self.side(gw)
            s.absorb(s.core.tick(self.now))  # type: ignore[arg-type]
            self.flush(gw)

    # ------------------------------------------------------------ invariants

    @invariant()
    def windows_never_negative_and_buffers_bounded(self) -> None:
        for s in (self.gw, self.ag):
            for state in s.core.streams.values():
                assert state.credit.available >= 0
                assert 0 <= state.recv.credit <= WINDOW
            for sid, b in s.buffered.items():
                assert 0 <= b <= WINDOW, f"stream {sid} buffered {b}"
            assert len(s.core.streams) <= MAX_STREAMS
            assert s.core.pending_bytes <= 64 * 1024

    @invariant()
    def closed_at_most_once(self) -> None:
        for s in (self.gw, self.ag):
            assert all(n == 1 for n in s.closes.values()), dict(s.closes)
            assert not set(s.closes) & set(s.core.streams)

    def teardown(self) -> None:
        """Both sides let go of what is left and everything is delivered: every stream ended on both sides."""
        self.budget = None
        for _ in range(50):
            for gw in (True, False):
                s = self.side(gw)
                for sid in self.open_ids(gw):
                    s.local(sid, lambda s=s, sid=sid: s.core.reset_stream(sid, wire.ResetCode.CANCEL, "teardown"))
                self.flush(gw)
                self.deliver(gw, 1000)
            if not self.wire[True] and not self.wire[False]:
                break
        for s in (self.gw, self.ag):
            assert not s.core.streams
            assert all(n == 1 for n in s.closes.values())
            if not s.ended:
                assert set(s.closes) == s.seen, (s.seen - set(s.closes))


TwoSessions.TestCase.settings = settings(max_examples=150, stateful_step_count=60, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])
TestTwoSessions = TwoSessions.TestCase


@settings(max_examples=400, deadline=None)
@given(st.lists(st.binary(max_size=80), max_size=6), st.booleans(), st.integers(1, 2))
def test_hostile_messages_never_raise(messages: list[bytes], opener: bool, version: int) -> None:
    s = core_pair(WINDOW, 4, version=version)[0 if opener else 1]
    for m in messages:
        s.receive(m, 0.0)  # anything but a crash: the protocol's answer is in the output
    assert isinstance(s.data_to_send(), list)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["data", "window", "end", "reset", "head", "open"]),
                          st.integers(0, 9), st.binary(max_size=40)), max_size=12))
def test_hostile_frames_with_valid_framing_never_raise(frames: list[tuple[str, int, bytes]]) -> None:
    """Well-framed but hostile frames (unknown streams, wrong order, bogus windows) on a live acceptor."""
    s = core_pair(WINDOW, 4)[1]
    encoded = []
    for kind, sid, payload in frames:
        if kind == "data":
            encoded.append(wire.encode_data(sid or 1, payload))
        elif kind == "window":
            encoded.append(wire.HEADER.pack(wire.FrameType.WINDOW, 0, sid) + payload[:4])
        elif kind == "end":
            encoded.append(wire.encode(wire.End(sid or 1)))
        elif kind == "reset":
            encoded.append(wire.encode(wire.Reset(sid or 1, sid, payload.decode("latin-1"))))
        elif kind == "head":
            encoded.append(wire.encode(wire.Head(sid or 1, 200)))
        else:
            encoded.append(wire.encode(wire.Open(sid or 1, wire.StreamKind.HTTP, "n", 1, "GET", "/", ())))
    message = b"".join(wire.length_prefix(len(f)) + f for f in encoded)
    if message:
        s.receive(message, 0.0)
    for state in s.streams.values():
        assert state.remote in (Half.BODY, Half.DONE) and state.recv.credit >= 0
