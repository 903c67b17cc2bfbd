"""A real :class:`~raven.transport.tunnel.Stream` without a session, for unit tests of the services' relays.

Compiled code checks the type of every stream it is handed (a duck-typed stand-in is refused), and a relay's test
wants a stream in a given state (a page that is all there, as it usually is). :func:`stream` makes the real
one over a :class:`RecordingLink` in place of its session; the test plays the peer through the stream's own
session events (:func:`deliver`), and the link records the resets the stream sent. (A test that needs the whole
session joins two in memory instead: tests/support/memsession.py.)
"""

from __future__ import annotations

import asyncio

from raven.protocol import wire
from raven.transport.tunnel import Stream, StreamReset


class RecordingLink:
    """The session side of a lone stream (raven/transport/stream.py's ``Link``): every send fits at once; a reset
    is recorded and ends the stream as the session does (the stream is aborted and let go)."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.resets: list[tuple[wire.ResetCode, str]] = []

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def congested(self, stream_id: int) -> bool:
        return False

    async def wait_send_room(self, stream_id: int) -> None:
        pass

    def consumed(self, stream_id: int, n: int) -> None:
        pass

    def send_data(self, stream_id: int, data: memoryview, fin: bool) -> int:
        return len(data)

    def send_head(self, stream: Stream, status: int, reason: str, headers: wire.Headers, fin: bool) -> None:
        pass

    def end_stream(self, stream: Stream) -> None:
        pass

    def reset_stream(self, stream: Stream, code: wire.ResetCode, reason: str) -> None:
        self.resets.append((code, reason))
        stream.aborted(StreamReset(code, reason, remote=False))
        stream.released()

    def done_writing(self, stream: Stream) -> None:
        pass


def stream(frame: wire.Open | None = None) -> tuple[Stream, RecordingLink]:
    """A stream the gateway opened (``frame``: a GET of /metrics on edge-1:9400 by default), and its link."""
    link = RecordingLink()
    frame = frame or wire.Open(1, wire.StreamKind.HTTP, "edge-1", 9400, "GET", "/metrics", (), fin=True)
    return Stream(link, frame.stream_id, frame, opener=True), link


def deliver(to: Stream, chunks: list[bytes]) -> None:
    """The peer's body, all of it here at once (as a page's DATA and FIN usually come in one message): each chunk
    as a DATA frame, a final ``b""`` as the FIN."""
    for chunk in chunks:
        to.data_received(memoryview(chunk), fin=not chunk)
