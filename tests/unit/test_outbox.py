"""raven/protocol/outbox.py without sockets: frames leave in order, batched within the budget, packets after them
and bounded."""

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


def test_version_2_batches_in_order_within_the_budget() -> None:
    box = Outbox(batched=True)
    chunk = b"x" * 40_000
    for i in range(10):
        box.data(1, memoryview(chunk), fin=i == 9)
    box.frame(wire.Window(3, 1000))
    messages = box.take()
    assert 1 < len(messages) <= 5
    assert all(len(m) <= Outbox.BATCH_BUDGET for m in messages)
    frames = frames_of(messages, batched=True)
    assert [type(f).__name__ for f in frames] == ["Data"] * 10 + ["Window"]
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
