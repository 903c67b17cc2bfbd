"""The asyncio session over the sans-I/O core: streams, flow control, resets, heartbeat, cleanup."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from raven.protocol import wire
from raven.protocol.flow import RecvWindow, SendCredit
from raven.transport.tunnel import Stream, StreamReset, Tunnel
from tests.support.memsession import batched, core_session, frames, http_open, pair
from tests.support.polling import eventually


def test_flow_accounting() -> None:
    recv = RecvWindow(100)
    recv.received(60, 1)
    assert recv.consumed(30) == 0
    assert recv.consumed(30) == 60  # half a window consumed: credit goes back in one batch
    assert recv.credit == 100
    with pytest.raises(wire.ProtocolError) as info:
        recv.received(101, 1)
    assert info.value.code == wire.ResetCode.FLOW_CONTROL
    send = SendCredit(10)
    assert send.take(25) == 10
    assert send.take(1) == 0
    send.grant(5, 1)
    assert send.take(25) == 5
    send.grant(1, 1)
    with pytest.raises(wire.ProtocolError):
        send.grant(wire.MAX_WINDOW_INCREMENT, 1)


async def _close_all(*sessions: Tunnel, tasks: list[asyncio.Task[None]]) -> None:
    for s in sessions:
        await s.close("test over")
    await asyncio.gather(*tasks, return_exceptions=True)


async def test_request_response_and_streams_released() -> None:
    body = bytes(range(256)) * 1000  # 256 KB, more than the 64 KiB window

    async def serve(stream: Stream) -> None:
        assert stream.open.node == "edge-1"
        assert await stream.read() == b""  # GET: no body
        stream.send_head(200, "OK", (("content-type", "text/plain"),))
        await stream.write(body)
        stream.end()

    def on_open(stream: Stream) -> None:
        asyncio.get_running_loop().create_task(serve(stream))

    gw, ag, tasks = await pair(on_open)
    try:
        stream = gw.open_stream(http_open())
        assert not stream.readable  # nothing has come back yet: a read would wait
        head = await asyncio.wait_for(stream.head(), 5)
        assert head.status == 200
        got = bytearray()
        while chunk := await asyncio.wait_for(stream.read(), 5):
            got += chunk
        assert bytes(got) == body
        await asyncio.sleep(0.05)
        assert gw.in_flight == 0 and ag.in_flight == 0
    finally:
        await _close_all(gw, ag, tasks=tasks)


async def test_slow_reader_does_not_stall_other_streams() -> None:
    big = b"x" * (1024 * 1024)

    async def serve(stream: Stream) -> None:
        stream.send_head(200, "OK", ())
        try:
            await stream.write(big if stream.open.target == "/big" else b"small")
            stream.end()
        except StreamReset:
            pass

    def on_open(stream: Stream) -> None:
        asyncio.get_running_loop().create_task(serve(stream))

    gw, ag, tasks = await pair(on_open, window=64 * 1024)
    try:
        slow = gw.open_stream(wire.Open(0, wire.StreamKind.HTTP, "edge-1", 9400, "GET", "/big", (), True))
        await asyncio.wait_for(slow.head(), 5)
        await asyncio.sleep(0.2)
        # The slow stream's sender is stuck on credit; at most one window is buffered here.
        buffered = sum(len(c) for c in slow._chunks)
        assert 0 < buffered <= 64 * 1024
        fast = gw.open_stream(http_open())
        await asyncio.wait_for(fast.head(), 5)
        assert await asyncio.wait_for(fast.read(), 5) == b"small"
        assert await asyncio.wait_for(fast.read(), 5) == b""
        slow.close()
        await asyncio.sleep(0.05)
        assert gw.in_flight == 0 and ag.in_flight == 0
    finally:
        await _close_all(gw, ag, tasks=tasks)


async def test_reset_reaches_the_opener_with_code() -> None:
    def on_open(stream: Stream) -> None:
        stream.reset(wire.ResetCode.CONNECT_FAILED, "dial 10.0.0.9:9400: connection refused")

    gw, ag, tasks = await pair(on_open)
    try:
        stream = gw.open_stream(http_open())
        with pytest.raises(StreamReset) as info:
            await asyncio.wait_for(stream.head(), 5)
        assert info.value.code == wire.ResetCode.CONNECT_FAILED
        assert "connection refused" in info.value.reason
        assert gw.in_flight == 0
    finally:
        await _close_all(gw, ag, tasks=tasks)


async def test_an_answer_sent_before_the_request_body_ended_is_read_whole_despite_the_reset_after_it() -> None:
    """The agent answers (a 405 to a POST) without reading the request body, then closes its stream, which resets
    it: the opener still reads the whole answer, even when the reset arrived before it began to read."""
    answered = asyncio.Event()

    async def serve(stream: Stream) -> None:
        stream.send_head(405, "Method Not Allowed", (("content-type", "text/plain"),))
        await stream.write(b"POST not allowed\n", end=True)
        stream.close()  # the request body never ended: CANCEL
        answered.set()

    def on_open(stream: Stream) -> None:
        asyncio.get_running_loop().create_task(serve(stream))

    gw, ag, tasks = await pair(on_open)
    try:
        stream = gw.open_stream(dataclasses.replace(http_open(), method="POST", fin=False))
        await stream.write(b"hel")  # part of the body; the rest never comes
        await asyncio.wait_for(answered.wait(), 5)
        await asyncio.sleep(0.1)  # HEAD, DATA with FIN and RESET are all delivered before anyone reads
        assert stream.reset_error is not None and stream.reset_error.code == wire.ResetCode.CANCEL
        head = await asyncio.wait_for(stream.head(), 5)
        assert head.status == 405
        assert stream.readable  # the gateway reads without arming a timer then
        assert await stream.read() == b"POST not allowed\n"
        assert stream.readable  # the end (and the reset) are here too
        assert await stream.read() == b""
    finally:
        await _close_all(gw, ag, tasks=tasks)


async def test_session_close_resets_every_stream() -> None:
    def on_open(stream: Stream) -> None:
        stream.send_head(200, "OK", ())

    gw, ag, tasks = await pair(on_open)
    try:
        stream = gw.open_stream(http_open())
        await asyncio.wait_for(stream.head(), 5)
        await ag.close("agent stopping")
        with pytest.raises(StreamReset) as info:
            await asyncio.wait_for(stream.read(), 5)
        assert info.value.code == wire.ResetCode.SESSION_CLOSED
        await asyncio.wait_for(gw.wait_closed(), 5)
        assert gw.in_flight == 0 and ag.in_flight == 0
    finally:
        await _close_all(gw, ag, tasks=tasks)


async def test_protocol_error_on_unknown_stream_and_garbage() -> None:
    gw, ag, tasks = await pair(lambda s: None)
    try:
        # DATA for a stream that never existed: the agent answers with RESET, session lives.
        ag.feed(batched(wire.encode_data(99, b"zz")))
        await asyncio.sleep(0.05)
        assert not ag.closed
        # Garbage on stream 0 ends the session, with a reason, no exception.
        ag.feed(batched(b"\xff\xff\x00\x00\x00\x00"))
        await asyncio.wait_for(ag.wait_closed(), 5)
        assert "unknown frame type" in ag.close_reason
    finally:
        await _close_all(gw, ag, tasks=tasks)


async def test_heartbeat_deadline_closes_silent_session(caplog: pytest.LogCaptureFixture) -> None:
    to_nowhere: asyncio.Queue[bytes | None] = asyncio.Queue()

    class Sink:
        async def send(self, message: bytes) -> None:
            await to_nowhere.put(message)

        async def send_many(self, messages: list[bytes]) -> None:
            for message in messages:
                await to_nowhere.put(message)

        async def close(self) -> None:
            pass

    s = Tunnel(Sink(), core_session(True, 1024, (0.1, 0.35), max_streams=1), name="lonely")
    s.start()
    await asyncio.wait_for(s.wait_closed(), 3)
    assert "heartbeat timeout" in s.close_reason
    # Chosen by the end's cause (EndCause.HEARTBEAT), not by the words: the line names the deadline.
    assert any(r.name == "raven.session" and "(deadline 0.3s): closing" in r.getMessage() for r in caplog.records)


class _StuckSink:
    """A transport whose peer never reads: every send blocks."""

    async def send(self, message: bytes) -> None:
        await asyncio.Event().wait()

    async def send_many(self, messages: list[bytes]) -> None:
        await asyncio.Event().wait()

    async def close(self) -> None:
        pass


async def test_replies_to_a_peer_that_does_not_read_are_bounded() -> None:
    s = Tunnel(_StuckSink(), core_session(True, 1024, (60, 120), max_streams=1), name="flooded")
    s.start()
    drain = wire.Drain("x" * 1000)
    for _ in range(Tunnel.HARD_LIMIT // 1000 + 10):
        s.send_control(drain)  # what unanswered peer-triggered replies do
        if s.closed:
            break
    await asyncio.wait_for(s.wait_closed(), 3)
    assert "over" in s.close_reason and "bytes queued" in s.close_reason


async def test_last_data_frame_carries_fin_instead_of_an_end_frame() -> None:
    async def serve(stream: Stream) -> None:
        stream.send_head(200, "OK", ())
        await stream.write(b"x" * 100_000, end=True)
        stream.end()  # idempotent after end=True

    def on_open(stream: Stream) -> None:
        asyncio.get_running_loop().create_task(serve(stream))

    gw, ag, tasks = await pair(on_open)
    try:
        stream = gw.open_stream(http_open())
        await asyncio.wait_for(stream.head(), 5)
        got = b""
        while chunk := await asyncio.wait_for(stream.read(), 5):
            got += bytes(chunk)
        assert len(got) == 100_000
        sent = frames(ag.sink.sent)  # type: ignore[attr-defined]
        data = [f for f in sent if isinstance(f, wire.Data)]
        assert data[-1].fin and not any(isinstance(f, wire.End) for f in sent)
        await asyncio.sleep(0.05)
        assert gw.in_flight == 0 and ag.in_flight == 0
    finally:
        await _close_all(gw, ag, tasks=tasks)


async def test_an_idle_session_keeps_no_writer_task_but_keeps_its_heartbeat() -> None:
    gw, ag, tasks = await pair(lambda s: None, heartbeat=(0.1, 1.0))
    try:
        await asyncio.sleep(0.6)
        # Each heartbeat's PING starts a writer for a moment (the check can land just after one was created):
        # an idle session is seen with none within a few turns, and a writer that stayed would never be.
        await eventually(lambda: gw._writer_task is None and ag._writer_task is None, 2.0,
                         "an idle session with no writer task on either side", interval=0.005)
        assert not gw.closed and not ag.closed
        loop = asyncio.get_running_loop()
        assert loop.time() - gw.core.last_rx < 0.5 and gw.core.rtt is not None  # PINGs answered
        stream = gw.open_stream(http_open())  # traffic brings a writer back
        assert gw._writer_task is not None
        stream.close()
    finally:
        await _close_all(gw, ag, tasks=tasks)


async def test_a_small_chunk_of_a_large_batched_message_does_not_keep_the_message_alive() -> None:
    gw, ag, tasks = await pair(lambda s: None)
    try:
        stream = gw.open_stream(http_open())
        # The agent's HEAD, then 1 byte of DATA beside a 512 KiB DRAIN-sized filler in one version-2 message:
        # the byte must not pin the whole message while it waits to be read.
        filler = wire.encode(wire.Drain("x" * 1000))
        message = batched(wire.encode(wire.Head(stream.id, 200)), wire.encode_data(stream.id, b"z"),
                          *([filler] * 500))
        gw.feed(message)
        chunk = stream._chunks[0]
        assert bytes(chunk) == b"z" and len(chunk.obj) == 1  # type: ignore[arg-type]
    finally:
        await _close_all(gw, ag, tasks=tasks)


async def test_a_peer_that_sends_but_never_reads_is_cut_off() -> None:
    """The peer keeps the session alive with PINGs but reads nothing: the stalled write ends the session."""
    s = Tunnel(_StuckSink(), core_session(True, 1024, (0.1, 0.3), max_streams=1), name="deaf")
    s.start()  # the write deadline: 3 heartbeat timeouts, 0.9 s
    s.send_control(wire.Drain("anything"))  # a write that will never complete
    ping = batched(wire.encode(wire.Ping(1)))
    loop = asyncio.get_running_loop()
    end = loop.time() + 5
    while not s.closed and loop.time() < end:
        s.feed(ping)  # never silent, so the heartbeat's silence check alone would not close it
        await asyncio.sleep(0.05)
    await asyncio.wait_for(s.wait_closed(), 3)
    assert "a write stalled" in s.close_reason
