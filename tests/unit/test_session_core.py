"""The sans-I/O session, step by step: batching, versions, the transition table, heartbeat as data."""

from __future__ import annotations

import pytest

from raven.protocol import handshake, wire
from raven.protocol.connection import Connection
from raven.protocol.errors import HandshakeCode, LocalProtocolError, RemoteProtocolError
from raven.protocol.events import (
    DatagramReceived,
    DataReceived,
    EndCause,
    HeadReceived,
    ProtocolViolation,
    SessionEnded,
    StreamAborted,
    StreamClosed,
    StreamOpened,
)
from raven.protocol.stream import TRANSITIONS, Half, Step
from tests.support.memsession import core_pair


def pair(version: int = 2) -> tuple[Connection, Connection]:
    return core_pair(65536, 8, version=version)


def op(node: str = "edge-1", fin: bool = True) -> wire.Open:
    return wire.Open(0, wire.StreamKind.HTTP, node, 9400, "GET", "/metrics", (), fin)


def relay(src: Connection, dst: Connection, now: float = 0.0) -> list[object]:
    events: list[object] = []
    for message in src.data_to_send():
        events += dst.receive(message, now)
    return events


def test_one_turn_of_frames_is_one_message_in_version_2_and_one_each_in_version_1() -> None:
    for version, expected in ((2, 1), (1, 3)):
        gw, ag = pair(version)
        ids = [gw.open_stream(op(f"edge-{i}")) for i in range(3)]
        messages = gw.data_to_send()
        assert len(messages) == expected
        events = [e for m in messages for e in ag.receive(m, 0.0)]
        assert [e.stream_id for e in events if isinstance(e, StreamOpened)] == ids


def test_batches_are_cut_at_the_budget() -> None:
    gw, ag = pair()
    sid = gw.open_stream(op())
    relay(gw, ag)
    ag.send_head(sid, 200, "OK", ())
    body = b"y" * 60_000
    while ag.send_data(sid, body):
        pass  # until the 64 KiB window is used up
    messages = ag.data_to_send()
    assert all(len(m) <= Connection.BATCH_BUDGET for m in messages)
    got = b"".join(bytes(e.data) for m in messages for e in gw.receive(m, 0.0) if isinstance(e, DataReceived))
    assert len(got) == 65536


def test_a_full_exchange_releases_the_stream_on_both_sides() -> None:
    gw, ag = pair()
    sid = gw.open_stream(op())
    assert any(isinstance(e, StreamOpened) for e in relay(gw, ag))
    ag.send_head(sid, 200, "OK", (("content-type", "text/plain"),))
    assert ag.send_data(sid, b"hello", fin=True) == 5
    assert not ag.alive(sid)  # both halves done on the agent's side
    events = relay(ag, gw)
    assert [type(e) for e in events] == [HeadReceived, DataReceived, StreamClosed]
    assert not gw.alive(sid) and gw.in_flight == 0


def test_the_transition_table_is_the_whole_lifecycle() -> None:
    assert TRANSITIONS[(Half.HEAD, Step.HEAD)] is Half.BODY
    assert (Half.DONE, Step.DATA) not in TRANSITIONS
    gw, ag = pair()
    sid = gw.open_stream(op())
    relay(gw, ag)
    with pytest.raises(LocalProtocolError):
        ag.send_data(sid, b"x")  # the agent must send HEAD first
    with pytest.raises(LocalProtocolError):
        gw.send_head(sid, 200, "OK", ())  # the opener never sends a head
    # The agent's DATA before HEAD, written by hand, resets only that stream.
    events = gw.receive(wire.length_prefix(6 + 2) + wire.encode_data(sid, b"zz"), 0.0)
    assert any(isinstance(e, ProtocolViolation) and "DATA before HEAD" in e.reason for e in events)
    assert any(isinstance(e, StreamAborted) and not e.remote for e in events)
    assert not gw.closed and not gw.alive(sid)
    assert isinstance(wire.decode(wire.split_batch(gw.data_to_send()[0])[0]), wire.Reset)


def test_heartbeat_is_driven_by_the_clock_it_is_given() -> None:
    gw, ag = core_pair(65536, 8, heartbeat=(1.0, 3.0), now=100.0)  # agreed at 100.0: counted from there
    assert gw.tick(100.5) == [] and gw.data_to_send() == []
    assert gw.tick(101.0) == []
    ping = gw.data_to_send()
    assert len(ping) == 1
    ag.receive(ping[0], 101.0)
    gw.receive(ag.data_to_send()[0], 101.25)  # the PONG
    assert gw.rtt == pytest.approx(0.25)
    assert gw.next_deadline() == pytest.approx(102.0)
    events = gw.tick(104.5)  # silent for more than 3 s
    assert isinstance(events[-1], SessionEnded) and "heartbeat timeout" in events[-1].reason
    assert events[-1].cause is EndCause.HEARTBEAT  # the code the transport's log line is chosen by
    assert gw.closed and gw.data_to_send() == []  # a silent peer gets no GOAWAY


def test_session_error_answers_goaway_and_aborts_every_stream() -> None:
    gw, ag = pair()
    sid = gw.open_stream(op())
    relay(gw, ag)
    events = ag.receive(b"\x00\x00\x00\x02zz", 0.0)  # a frame length below the header size
    assert [type(e) for e in events] == [ProtocolViolation, StreamAborted, StreamClosed, SessionEnded]
    assert isinstance(events[-1], SessionEnded) and events[-1].cause is EndCause.PROTOCOL
    assert ag.closed and not ag.alive(sid)
    goaway = wire.decode(wire.split_batch(ag.data_to_send()[0])[0])
    assert isinstance(goaway, wire.GoAway) and goaway.code == wire.ResetCode.PROTOCOL


def test_versions_are_negotiated_to_the_newest_common_one() -> None:
    assert handshake.choose_version([1, 2]) == 2
    assert handshake.choose_version([1]) == 1
    with pytest.raises(RemoteProtocolError) as info:
        handshake.choose_version([7])
    assert info.value.code is HandshakeCode.VERSION and "agent speaks [7]" in info.value.text


def test_a_mutable_buffer_is_copied_before_the_caller_can_reuse_it() -> None:
    gw, ag = pair()
    sid = gw.open_stream(op(fin=False))
    buf = bytearray(b"abc")
    gw.send_data(sid, buf)  # a bytearray, on purpose (compiled code checks the declared types)
    buf[:] = b"xyz"  # the caller reuses its buffer before the writer runs
    events = relay(gw, ag)
    assert [bytes(e.data) for e in events if isinstance(e, DataReceived)] == [b"abc"]


def test_datagrams_go_after_stream_frames_and_are_dropped_not_queued_when_full() -> None:
    gw, ag = pair()
    packet = b"E" + b"\x00" * 1399
    sent = 0
    while gw.send_datagram(packet):
        sent += 1
    assert 0 < sent * 1410 <= Connection.DATAGRAM_QUEUE and gw.datagrams_dropped == 1
    sid = gw.open_stream(op())  # queued after the packets, sent before them
    events = relay(gw, ag)
    assert isinstance(events[0], StreamOpened) and events[0].stream_id == sid
    assert sum(isinstance(e, DatagramReceived) and bytes(e.packet) == packet for e in events) == sent
    v1, _ = pair(version=1)
    assert not v1.send_datagram(packet)  # version 1 sessions carry no layer 3


def test_routes_frames_round_trip_and_hostile_ones_are_refused() -> None:
    frame = wire.Routes(("10.20.0.0/16", "fd00::/64"), active=True)
    assert wire.decode(wire.encode(frame)) == frame
    with pytest.raises(wire.ProtocolError):
        wire.decode(wire.HEADER.pack(wire.FrameType.ROUTES, 0, 0) + b'{"cidrs": ["x"], "active": 1}')
    with pytest.raises(wire.ProtocolError):
        wire.decode(wire.HEADER.pack(wire.FrameType.DATAGRAM, 0, 0))  # an empty packet


def test_an_agent_bounds_the_heartbeat_a_gateway_asks_for() -> None:
    gw, ag = core_pair(heartbeat=(1e-9, 1e-9))
    assert ag.heartbeat_interval == handshake.MIN_HEARTBEAT_INTERVAL
    assert ag.heartbeat_timeout == 2 * handshake.MIN_HEARTBEAT_INTERVAL
    assert gw.heartbeat_interval == 1e-9  # the gateway keeps what it chose for itself


def test_a_peer_flooding_frames_that_do_nothing_is_cut_off() -> None:
    gw, ag = pair()
    sid = gw.open_stream(op(fin=False))
    relay(gw, ag)
    empty = wire.length_prefix(6) + wire.encode_data(sid, b"")
    burst = empty * 2000  # one message of 2,000 empty DATA frames
    for _ in range(5):
        ag.receive(burst, 0.0)  # 10,000 at once: the whole burst allowance
    assert not ag.closed
    events = ag.receive(burst, 0.0)
    assert ag.closed and isinstance(events[-1], SessionEnded) and "do nothing" in events[-1].reason
    assert events[-1].cause is EndCause.PROTOCOL
    gw2, ag2 = pair()
    sid2 = gw2.open_stream(op(fin=False))
    relay(gw2, ag2)
    for t in range(20):  # at the allowed rate it goes on
        ag2.receive(empty * 900, float(t))
    assert not ag2.closed and ag2.alive(sid2)


def test_a_scrape_opened_behind_a_download_backlog_is_answered_first() -> None:
    """Issue 29 item 9: the agent has a download's window (256 KiB) queued and the link takes 16 KiB per turn;
    a scrape opened later gets its head and page out in the next turn, ahead of the backlog, and the download
    and a reset behind a complete answer keep their order."""
    window = 256 * 1024
    gw, ag = core_pair(window, 8)
    download = gw.open_stream(op())
    relay(gw, ag)
    ag.send_head(download, 200, "OK", ())
    sent = 0
    while n := ag.send_data(download, memoryview(bytes(range(256)) * 256)[: 64 * 1024]):
        sent += n
    assert sent == window
    got: dict[int, int] = {download: 0}

    def link_turn(budget: int) -> list[object]:
        events: list[object] = [e for m in ag.data_to_send(budget) for e in gw.receive(m, 0.0)]
        for e in events:
            if isinstance(e, DataReceived):
                got[e.stream_id] = got.get(e.stream_id, 0) + len(e.data)
        return events

    link_turn(16 * 1024)
    scrape = gw.open_stream(op("edge-2"))
    relay(gw, ag)
    ag.send_head(scrape, 200, "OK", (("content-encoding", "gzip"),))
    ag.send_data(scrape, b"p" * 5000, fin=True)
    events = link_turn(16 * 1024)
    assert [type(e) for e in events if getattr(e, "stream_id", 0) == scrape] == [HeadReceived, DataReceived,
                                                                                 StreamClosed]
    assert got[scrape] == 5000 and got[download] < 32 * 1024
    ag.reset_stream(download, wire.ResetCode.CANCEL, "stop")  # its data is not all queued: dropped, reset at once
    events = link_turn(16 * 1024)
    assert any(isinstance(e, StreamAborted) and e.stream_id == download for e in events)
    assert ag.pending_bytes == 0 and got[download] < 48 * 1024


def _big_pair() -> tuple[Connection, Connection]:
    return core_pair(256 * 1024, 8)


def test_goaway_leaves_at_close_without_waiting_for_aborted_streams_data() -> None:
    """Closing with downloads' windows queued (about 1 MiB): the aborted streams' data is dropped, so GOAWAY
    leaves in the next small turn of a slow link; a complete answer (its FIN queued) still goes before it."""
    gw, ag = _big_pair()
    downloads = [gw.open_stream(op(f"edge-{i}")) for i in range(4)]
    answered = gw.open_stream(op("edge-9", fin=False))  # the request body still comes: the stream stays open
    relay(gw, ag)
    for sid in downloads:
        ag.send_head(sid, 200, "OK", ())
        while ag.send_data(sid, b"d" * 65536):
            pass
    ag.send_head(answered, 200, "OK", ())
    ag.send_data(answered, b"a" * 3000, fin=True)
    assert ag.pending_bytes > 4 * 250_000
    ag.close(wire.ResetCode.SESSION_CLOSED, "agent stopping")
    frames = [f for m in ag.data_to_send(16 * 1024) for f in wire.split_batch(m)]
    decoded = [wire.decode(f) for f in frames]
    assert isinstance(decoded[-1], wire.GoAway) and ag.pending_bytes == 0
    data = [f for f in decoded if isinstance(f, wire.Data)]
    assert {f.stream_id for f in data} == {answered} and sum(len(f.data) for f in data) == 3000 and data[-1].fin


def test_a_stream_error_after_a_complete_answer_resets_behind_it() -> None:
    """One rule for every abort (reset_stream, a peer's stream error, the session's end): a stream whose FIN is
    queued keeps its answer and the RESET goes behind it; a stream still sending loses its data, RESET first."""
    gw, ag = _big_pair()
    done = gw.open_stream(op("edge-1", fin=False))
    busy = gw.open_stream(op("edge-2", fin=False))
    relay(gw, ag)
    for sid, fin in ((done, True), (busy, False)):
        ag.send_head(sid, 200, "OK", ())
        assert ag.send_data(sid, b"x" * 50_000, fin=fin) == 50_000
    for sid in (done, busy):  # a HEAD from the peer on a stream it opened: a stream error for each
        head = wire.encode(wire.Head(sid, 200))
        events = ag.receive(wire.length_prefix(len(head)) + head, 0.0)
        assert any(isinstance(e, StreamAborted) and e.stream_id == sid for e in events)
    decoded = [wire.decode(f) for m in ag.data_to_send() for f in wire.split_batch(m)]
    mine = {sid: [f for f in decoded if getattr(f, "stream_id", 0) == sid] for sid in (done, busy)}
    assert isinstance(mine[done][-1], wire.Reset) and sum(
        len(f.data) for f in mine[done] if isinstance(f, wire.Data)) == 50_000
    assert [type(f) for f in mine[busy]] == [wire.Head, wire.Reset]
