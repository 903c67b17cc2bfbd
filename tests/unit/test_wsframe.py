"""The RFC 6455 codec in the core (raven/protocol/wsframe.py): round trips in any chunking, every refusal the RFC
asks for with its close code and a reason, hostile bytes never raising anything but the codec's own error, and a
differential against aiohttp's own reader and writer (frames written by one, decoded by the other, both ways)."""

from __future__ import annotations

import asyncio
import os
import struct
from typing import Any

import pytest
from aiohttp._websocket.helpers import websocket_mask
from aiohttp._websocket.reader import WebSocketDataQueue, WebSocketReader
from aiohttp._websocket.writer import WebSocketWriter
from aiohttp.http_websocket import WSMsgType
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from raven.protocol.wsframe import (
    OP_BINARY,
    OP_CLOSE,
    OP_CONTINUATION,
    OP_PING,
    OP_PONG,
    OP_TEXT,
    Close,
    FrameDecoder,
    FrameEncoder,
    Ping,
    Pong,
    WebSocketError,
    mask_python,
)
from tests.support.wsframes import raw_frame

MAX = 1 << 16


def chunked(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    out, last = [], 0
    for p in [*points, len(data)]:
        out.append(data[last:p])
        last = p
    return out


def decode_all(dec: FrameDecoder, chunks: list[bytes]) -> list[Any]:
    events: list[Any] = []
    for chunk in chunks:
        events += dec.receive(chunk)
    return [bytes(e) if isinstance(e, bytearray) else e for e in events]


# ------------------------------------------------------------------ round trips


@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.binary(max_size=3000), max_size=8), st.lists(st.integers(0, 1 << 20), max_size=12),
       st.booleans())
def test_round_trip_any_chunking(messages: list[bytes], cuts: list[int], client_sends: bool) -> None:
    enc = FrameEncoder(client=client_sends)
    dec = FrameDecoder(client=not client_sends, max_message=MAX)
    wire = enc.binary(messages) if messages else b""
    wire += enc.ping(b"p") + enc.close(1000, "bye")
    got = decode_all(dec, chunked(wire, cuts))
    assert got == [*messages, Ping(b"p"), Close(1000, "bye")]


def test_big_messages_both_sizes_of_length() -> None:
    for n in (125, 126, 65535, 65536, 200_000):
        data = os.urandom(n)
        for client in (True, False):
            dec = FrameDecoder(client=not client, max_message=n)
            assert decode_all(dec, [FrameEncoder(client=client).binary([data])]) == [data]


def test_fragmented_message_is_joined_and_controls_may_interleave() -> None:
    parts = [b"ab", b"", b"cd", b"e"]
    wire = raw_frame(OP_BINARY, parts[0], fin=False, mask=True)
    wire += raw_frame(OP_CONTINUATION, parts[1], fin=False, mask=True)
    wire += raw_frame(OP_PING, b"mid", mask=True)
    wire += raw_frame(OP_CONTINUATION, parts[2], fin=False, mask=True)
    wire += raw_frame(OP_CONTINUATION, parts[3], fin=True, mask=True)
    got = decode_all(FrameDecoder(client=False, max_message=MAX), [wire[i:i + 3] for i in range(0, len(wire), 3)])
    assert got == [Ping(b"mid"), b"abcde"]


def test_close_without_code_and_nothing_after_it() -> None:
    dec = FrameDecoder(client=True, max_message=MAX)
    assert dec.receive(raw_frame(OP_CLOSE, b"") + raw_frame(OP_BINARY, b"late")) == [Close(None, "")]
    assert dec.receive(raw_frame(OP_BINARY, b"later")) == []


def test_close_reason_is_cut_on_a_character() -> None:
    frame = FrameEncoder(client=False).close(1001, "é" * 100)
    (ev,) = FrameDecoder(client=True, max_message=MAX).receive(frame)
    assert isinstance(ev, Close) and ev.code == 1001 and ev.reason == "é" * 61


def test_python_mask_matches_aiohttps() -> None:
    for n in (0, 1, 3, 4, 5, 1000, 50_001):
        data, key = os.urandom(n), os.urandom(4)
        a, b = bytearray(data), bytearray(data)
        mask_python(key, a)
        websocket_mask(key, b)
        assert a == b


# ------------------------------------------------------------------ refusals, each with its code and reason


# Named by their reasons: a masked frame carries a random key, and xdist's workers must collect the same ids.
REFUSALS = [
    (False, raw_frame(OP_BINARY, b"x"), 1002, "unmasked frame from the client"),
    (True, raw_frame(OP_BINARY, b"x", mask=True), 1002, "masked frame from the server"),
    (False, raw_frame(OP_BINARY, b"", mask=True, length=1 << 62), 1009, "limit 65536"),
    (False, raw_frame(OP_BINARY, b"", mask=True, length=MAX + 1), 1009, "limit 65536"),
    (False, raw_frame(0x3, b"x", mask=True), 1002, "unknown opcode 0x3"),
    (False, raw_frame(0xB, b"x", mask=True), 1002, "unknown opcode 0xb"),
    (False, raw_frame(OP_PING, b"x", fin=False, mask=True), 1002, "fragmented control frame"),
    (False, raw_frame(OP_PONG, b"x" * 126, mask=True), 1002, "control frame of 126 bytes"),
    (False, raw_frame(OP_CONTINUATION, b"x", mask=True), 1002, "no message begun"),
    (False, raw_frame(OP_BINARY, b"a", fin=False, mask=True) + raw_frame(OP_BINARY, b"b", mask=True), 1002,
     "middle of a fragmented one"),
    (False, raw_frame(OP_TEXT, b"hi", mask=True), 1003, "binary messages only"),
    (False, raw_frame(OP_BINARY, b"x", rsv=0x40, mask=True), 1002, "reserved bits"),
    (False, raw_frame(OP_CLOSE, b"\x03", mask=True), 1002, "1-byte payload"),
    (False, raw_frame(OP_CLOSE, struct.pack("!H", 1005), mask=True), 1002, "invalid code 1005"),
    (False, raw_frame(OP_CLOSE, struct.pack("!H", 1000) + b"\xff", mask=True), 1007, "not UTF-8"),
]


@pytest.mark.parametrize(("client", "wire", "code", "words"), REFUSALS,
                         ids=[f"{i}-{case[3]}" for i, case in enumerate(REFUSALS)])
def test_refused_with_code_and_reason(client: bool, wire: bytes, code: int, words: str) -> None:
    dec = FrameDecoder(client=client, max_message=MAX)
    with pytest.raises(WebSocketError) as info:
        dec.receive(wire)
    assert info.value.code == code and words in info.value.reason
    assert dec.receive(raw_frame(OP_BINARY, b"after", mask=not client)) == []  # nothing more after an error


def test_fragments_together_over_the_limit_are_refused_from_a_header() -> None:
    dec = FrameDecoder(client=False, max_message=10)
    dec.receive(raw_frame(OP_BINARY, b"x" * 6, fin=False, mask=True))
    # Only the header of the second fragment arrives: refused before its payload is held.
    with pytest.raises(WebSocketError) as info:
        dec.receive(raw_frame(OP_CONTINUATION, b"y" * 5, mask=True)[:6])
    assert info.value.code == 1009
    assert dec.buffered == 0


def test_a_ping_between_fragments_does_not_count_toward_the_message() -> None:
    """A message within 125 bytes of the limit, a full-size ping and a pong between its fragments: the controls
    are answered and the message is whole (their lengths once made it over the limit: 1009)."""
    dec = FrameDecoder(client=False, max_message=1000)
    wire = raw_frame(OP_BINARY, b"a" * 950, fin=False, mask=True)
    wire += raw_frame(OP_PING, b"p" * 125, mask=True) + raw_frame(OP_PONG, b"q" * 125, mask=True)
    wire += raw_frame(OP_CONTINUATION, b"b" * 50, mask=True)
    assert decode_all(dec, [wire]) == [Ping(b"p" * 125), Pong(b"q" * 125), b"a" * 950 + b"b" * 50]
    # The limit still holds for the message's own bytes.
    dec.receive(raw_frame(OP_BINARY, b"a" * 950, fin=False, mask=True) + raw_frame(OP_PING, b"p", mask=True))
    with pytest.raises(WebSocketError) as info:
        dec.receive(raw_frame(OP_CONTINUATION, b"b" * 51, mask=True))
    assert info.value.code == 1009


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=400), st.booleans(), st.lists(st.integers(0, 400), max_size=5))
def test_hostile_bytes_raise_only_the_codecs_error(data: bytes, client: bool, cuts: list[int]) -> None:
    dec = FrameDecoder(client=client, max_message=200)
    try:
        for chunk in chunked(data, cuts):
            for ev in dec.receive(chunk):
                assert isinstance(ev, (bytes, bytearray, Ping, Pong, Close))
                if isinstance(ev, (bytes, bytearray)):
                    assert len(ev) <= 200
    except WebSocketError as err:
        assert 1000 <= err.code < 1012 and err.reason
    assert dec.buffered <= 200 + 14


# ------------------------------------------------------------------ differential against aiohttp


class _ReadProtocol:
    _reading_paused = False

    def pause_reading(self) -> None:
        self._reading_paused = True


def aiohttp_reader(max_size: int) -> tuple[WebSocketReader, WebSocketDataQueue, asyncio.AbstractEventLoop]:
    """aiohttp's own reader (its compiled one where installed) and its queue, fed by hand."""
    loop = asyncio.new_event_loop()
    queue = WebSocketDataQueue(_ReadProtocol(), 1 << 30, loop=loop)  # type: ignore[arg-type]
    return WebSocketReader(queue, max_size, compress=False, decode_text=False), queue, loop


def queued(queue: WebSocketDataQueue) -> list[Any]:
    return [m for m, _ in queue._buffer]


class _Transport:
    def __init__(self) -> None:
        self.out = bytearray()

    def write(self, data: bytes) -> None:
        self.out += data

    def is_closing(self) -> bool:
        return False


class _Protocol:
    _paused = False


def aiohttp_decode(wire: bytes, chunks: list[int]) -> list[Any]:
    reader, queue, loop = aiohttp_reader(MAX)
    for chunk in chunked(wire, chunks):
        reader.feed_data(chunk)
    loop.close()
    assert queue.exception() is None
    out: list[Any] = []
    for m in queued(queue):
        if m.type == WSMsgType.BINARY:
            out.append(bytes(m.data))
        elif m.type == WSMsgType.PING:
            out.append(Ping(bytes(m.data)))
        elif m.type == WSMsgType.PONG:
            out.append(Pong(bytes(m.data)))
        elif m.type == WSMsgType.CLOSE:
            out.append(Close(m.data, m.extra))
    return out


async def aiohttp_encode(items: list[tuple[int, bytes]], mask: bool) -> bytes:
    transport = _Transport()
    writer = WebSocketWriter(_Protocol(), transport, use_mask=mask)  # type: ignore[arg-type]
    for opcode, payload in items:
        if opcode == OP_CLOSE:
            await writer.close(struct.unpack("!H", payload[:2])[0], payload[2:])
        else:
            await writer.send_frame(payload, opcode)
    return bytes(transport.out)


items_strategy = st.lists(st.one_of(
    st.tuples(st.just(OP_BINARY), st.binary(max_size=70_000)),
    st.tuples(st.sampled_from([OP_PING, OP_PONG]), st.binary(max_size=125)),
), max_size=6)


@settings(max_examples=60, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(items_strategy, st.booleans(), st.lists(st.integers(0, 1 << 18), max_size=8),
       st.text(max_size=40))
def test_ours_written_aiohttp_reads(items: list[tuple[int, bytes]], client: bool, cuts: list[int],
                                    reason: str) -> None:
    enc = FrameEncoder(client=client, masker=websocket_mask)
    wire = b"".join(enc.frame(op, p) for op, p in items) + enc.close(4000, reason)
    got = aiohttp_decode(wire, cuts)
    expect = [Ping(p) if op == OP_PING else Pong(p) if op == OP_PONG else p for op, p in items]
    assert got == [*expect, Close(4000, reason.encode()[:123].decode("utf-8", "ignore"))]


@settings(max_examples=60, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(items_strategy, st.booleans(), st.lists(st.integers(0, 1 << 18), max_size=8),
       st.text(max_size=40))
def test_aiohttp_written_ours_reads(items: list[tuple[int, bytes]], client: bool, cuts: list[int],
                                    reason: str) -> None:
    close = struct.pack("!H", 1001) + reason.encode()[:123].decode("utf-8", "ignore").encode()
    wire = asyncio.run(aiohttp_encode([*items, (OP_CLOSE, close)], mask=client))
    dec = FrameDecoder(client=not client, max_message=MAX + 70_000, masker=websocket_mask)
    expect = [Ping(p) if op == OP_PING else Pong(p) if op == OP_PONG else p for op, p in items]
    assert decode_all(dec, chunked(wire, cuts)) == [*expect, Close(1001, close[2:].decode())]


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=300))
def test_what_aiohttp_refuses_we_refuse(data: bytes) -> None:
    """Hostile bytes, masked as a client's: where aiohttp's reader reports an error before any message, ours does too
    (we refuse more: text, reserved bits, a wrongly masked frame, which aiohttp accepts or handles elsewhere)."""
    reader, queue, loop = aiohttp_reader(200)
    reader.feed_data(data)
    loop.close()
    dec = FrameDecoder(client=False, max_message=199)  # aiohttp's limit is exclusive
    try:
        ours: list[Any] = dec.receive(data)
        refused = False
    except WebSocketError:
        refused = True
    if queue.exception() is not None and not queued(queue):
        assert refused
    if queue.exception() is None and not refused:
        theirs = [bytes(m.data) for m in queued(queue) if m.type == WSMsgType.BINARY]
        assert [bytes(e) for e in ours if isinstance(e, (bytes, bytearray))] == theirs
