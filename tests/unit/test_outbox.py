"""raven/protocol/outbox.py without sockets: control frames first, then the streams' data in order of service
(the least served stream first, bulk streams round robin behind), batched within the budget; packets bounded."""

from __future__ import annotations

from raven.protocol import wire
from raven.protocol.outbox import Outbox


def frames_of(messages: list[bytes], batched: bool) -> list[wire.Frame]:
    out: list[wire.Frame] = []
    for message in messages:
        parts = wire.split_batch(message) if batched else [memoryview(message)]
        out.extend(wire.decode(part) for part in parts)
    return out


def test_version_1_sends_one_frame_per_message() -> None:
    box = Outbox(batched=False)
    box.frame(wire.Ping(7))
    box.data(1, memoryview(b"abc"), fin=True)
    assert box.pending_bytes > 0
    messages = box.take()
    assert len(messages) == 2 and box.pending_bytes == 0
    ping, data = frames_of(messages, batched=False)
    assert ping == wire.Ping(7)
    assert isinstance(data, wire.Data) and bytes(data.data) == b"abc" and data.fin
    assert box.take() == []


def test_version_2_batches_within_the_budget_control_frames_first() -> None:
    box = Outbox(batched=True)
    chunk = b"x" * 40_000
    for i in range(10):
        box.data(1, memoryview(chunk), fin=i == 9)
    box.frame(wire.Window(3, 1000))
    messages = box.take()
    assert 1 < len(messages) <= 5
    assert all(len(m) <= Outbox.BATCH_BUDGET for m in messages)
    frames = frames_of(messages, batched=True)
    assert [type(f).__name__ for f in frames] == ["Window"] + ["Data"] * 10
    assert b"".join(bytes(f.data) for f in frames if isinstance(f, wire.Data)) == chunk * 10


def test_a_mutable_buffer_is_copied_when_queued() -> None:
    box = Outbox(batched=True)
    buf = bytearray(b"before")
    box.data(1, memoryview(buf), fin=False)
    buf[:] = b"after!"
    (data,) = frames_of(box.take(), batched=True)
    assert isinstance(data, wire.Data) and bytes(data.data) == b"before"


def test_datagrams_go_after_frames_and_are_bounded() -> None:
    box = Outbox(batched=True)
    packet = b"\x45" + b"\x00" * 1399
    accepted = 0
    while box.datagram(packet):
        accepted += 1
    assert 0 < accepted * 1400 <= Outbox.DATAGRAM_QUEUE
    box.frame(wire.Ping(1))
    frames = frames_of(box.take(), batched=True)
    assert isinstance(frames[0], wire.Ping)
    assert all(isinstance(f, wire.Datagram) for f in frames[1:]) and len(frames) == accepted + 1
    assert box.datagram(packet)  # room again once taken


def test_version_1_carries_no_datagrams_and_dropping_frees_the_queue() -> None:
    assert not Outbox(batched=False).datagram(b"\x45" * 100)
    box = Outbox(batched=True)
    assert box.datagram(b"\x45" * 100)
    box.drop_datagrams()
    assert box.pending_bytes == 0 and box.take() == []


def data_of(frames: list[wire.Frame]) -> list[tuple[int, int]]:
    """(stream, payload bytes) of each DATA frame, in the order they left."""
    return [(f.stream_id, len(f.data)) for f in frames if isinstance(f, wire.Data)]


def test_a_small_stream_opened_behind_a_bulk_backlog_leaves_first() -> None:
    """Issue 29 item 9: a download has 512 KiB queued; a scrape's page queued after it leaves in the next take,
    not behind the backlog, and the download then takes the rest."""
    box = Outbox(batched=True)
    bulk = memoryview(b"b" * 65536)
    for _ in range(8):
        box.data(1, bulk, fin=False)
    first = data_of(frames_of(box.take(32 * 1024), batched=True))  # the link took 32 KiB of it
    assert first and {sid for sid, _ in first} == {1} and sum(n for _, n in first) <= 32 * 1024
    box.frame(wire.Head(3, 200, "OK", (), False))
    box.data(3, memoryview(b"s" * 5000), fin=True)  # the scrape's page
    frames = frames_of(box.take(16 * 1024), batched=True)
    assert isinstance(frames[0], wire.Head)
    assert data_of(frames)[0] == (3, 5000) and isinstance(frames[1], wire.Data) and frames[1].fin
    rest = data_of(frames_of(box.take(), batched=True))
    assert {sid for sid, _ in rest} <= {1}
    assert sum(n for _, n in first + data_of(frames) + rest) == 8 * 65536 + 5000
    assert box.pending_bytes == 0


def test_the_least_served_stream_goes_first_and_bulk_streams_share() -> None:
    box = Outbox(batched=True)
    chunk = memoryview(b"x" * 65536)
    for sid in (1, 3):  # two downloads, each past BULK_AFTER
        for _ in range(Outbox.BULK_AFTER // 65536):
            box.data(sid, chunk, fin=False)
    box.take()
    for sid in (1, 3):
        for _ in range(3):
            box.data(sid, chunk, fin=False)
    box.data(5, memoryview(b"p" * 50_000), fin=True)  # an uncompressed page: served before the bulk
    order = data_of(frames_of(box.take(120_000), batched=True))  # the link takes less than is queued
    page = [i for i, (sid, _) in enumerate(order) if sid == 5]
    assert page == list(range(len(page))) and sum(order[i][1] for i in page) == 50_000
    bulk = [sid for sid, _ in order[len(page):]]
    assert bulk[:4] in ([1, 3, 1, 3], [3, 1, 3, 1])  # round robin, QUANTUM each
    assert all(n <= Outbox.QUANTUM for _, n in order)
    rest = data_of(frames_of(box.take(), batched=True))  # a link with room for all: whole frames, in order
    assert sum(n for _, n in order + rest) == 50_000 + 6 * 65536


def test_end_and_reset_wait_behind_their_streams_data() -> None:
    box = Outbox(batched=True)
    for _ in range(2):
        box.data(1, memoryview(b"a" * 50_000), fin=False)
    box.after_data(1, wire.End(1))
    box.data(3, memoryview(b"c" * 50_000), fin=False)
    box.data(3, memoryview(b"c" * 50_000), fin=True)
    box.after_data(3, wire.Reset(3, wire.ResetCode.CANCEL, "stop sending"))
    box.after_data(5, wire.End(5))  # nothing queued for stream 5: at once
    frames = frames_of(box.take(), batched=True)
    assert frames[0] == wire.End(5)
    for sid, last in ((1, wire.End), (3, wire.Reset)):
        mine = [f for f in frames if getattr(f, "stream_id", 0) == sid]
        assert isinstance(mine[-1], last) and all(isinstance(f, wire.Data) for f in mine[:-1])
        assert sum(len(f.data) for f in mine if isinstance(f, wire.Data)) == 100_000


def test_a_dropped_stream_sends_nothing_more_and_goaway_goes_last() -> None:
    box = Outbox(batched=True)
    box.data(1, memoryview(b"a" * 60_000), fin=False)
    box.data(1, memoryview(b"a" * 40_000), fin=False)
    box.take(20_000)
    box.drop(1)
    box.frame(wire.GoAway(0, "bye"))
    box.data(3, memoryview(b"c" * 1000), fin=True)
    frames = frames_of(box.take(), batched=True)
    assert data_of(frames) == [(3, 1000)] and isinstance(frames[-1], wire.GoAway)
    assert box.pending_bytes == 0


def test_a_budget_is_kept_by_splitting_data_frames() -> None:
    box = Outbox(batched=False)
    box.data(1, memoryview(b"z" * 60_000), fin=True)
    sizes = []
    while box.pending_bytes:
        frames = frames_of(box.take(10_000), batched=False)
        sizes.append(sum(len(f.data) for f in frames if isinstance(f, wire.Data)))
        assert all(isinstance(f, wire.Data) and f.fin == (box.pending_bytes == 0) for f in frames)
    assert sum(sizes) == 60_000 and max(sizes) <= 10_000 and len(sizes) == 7


def test_streams_reset_with_data_queued_leave_no_trace() -> None:
    """A peer that makes the agent answer and reset thousands of streams before the link takes anything: the
    outbox's bookkeeping stays bounded (the ready list is pruned, not left to grow until a take)."""
    box = Outbox(batched=True)
    for sid in range(1, 20_001, 2):
        box.data(sid, memoryview(b"q" * 100), fin=True)
        box.drop(sid)
    assert box.pending_bytes == 0 and len(box._ready or ()) <= 64 and not box._flows  # left of 10,000 streams
    assert box.take() == [] and box._ready is None


def test_no_empty_data_frame_leaves_whatever_the_budgets() -> None:
    """A small chunk behind a budget smaller than it: taken whole, never split into itself and an empty rest
    (an empty DATA frame without FIN is a void frame to the peer, which counts them and ends the session)."""
    import random

    rng = random.Random(29)
    for batched in (False, True):
        for _ in range(200):
            box = Outbox(batched=batched)
            for sid in (1, 3, 5):
                for _ in range(rng.randint(1, 4)):
                    box.data(sid, memoryview(b"d" * rng.choice((1, 100, 1000, 1024, 1500, 20_000))), fin=False)
            box.data(7, memoryview(b""), fin=True)
            while box.pending_bytes:
                frames = frames_of(box.take(rng.choice((1, 10, 50, 1000, 1030, 2000, 16_400, 40_000))), batched)
                assert all(f.data or f.fin for f in frames if isinstance(f, wire.Data)), frames
            assert box.take() == []


def test_the_reported_budgets_send_no_empty_frame() -> None:
    box = Outbox(batched=True)
    box.data(1, memoryview(b"a" * 20_000), fin=False)
    for _ in range(2):
        box.data(3, memoryview(b"b" * 100), fin=False)
    frames = [f for budget in (16_400, 50, 50, None) for f in frames_of(box.take(budget), batched=True)]
    assert [f for f in frames if isinstance(f, wire.Data) and not f.data] == []
    assert sum(len(f.data) for f in frames if isinstance(f, wire.Data)) == 20_200


def test_bulk_streams_and_packets_are_served_while_small_streams_keep_coming() -> None:
    """A steady flow of new small streams (each under BULK_AFTER): the download past BULK_AFTER and the layer-3
    packets still get one turn after every SMALL_TURNS small ones; the small streams keep most of the link."""
    box = Outbox(batched=True)
    for _ in range(Outbox.BULK_AFTER // 65536 + 1):
        box.data(1, memoryview(b"x" * 65536), fin=False)
    box.take(Outbox.BULK_AFTER + 1000)  # stream 1 is bulk now
    for _ in range(100):
        box.data(1, memoryview(b"x" * 65536), fin=False)
    packets = 0
    while box.datagram(b"p" * 1200):
        packets += 1
    got: dict[str, int] = {"bulk": 0, "small": 0, "packets": 0}
    sid = 3
    for _ in range(100):  # every take, a new scrape arrives with a page in flight
        box.data(sid, memoryview(b"s" * 40_000), fin=True)  # more than the link takes
        sid += 2
        for frame in frames_of(box.take(2 * Outbox.QUANTUM), batched=True):
            if isinstance(frame, wire.Datagram):
                got["packets"] += 1
            elif isinstance(frame, wire.Data):
                got["bulk" if frame.stream_id == 1 else "small"] += len(frame.data)
    assert got["bulk"] > 5 * Outbox.QUANTUM and got["packets"] > 50
    assert got["small"] > 2 * got["bulk"]
