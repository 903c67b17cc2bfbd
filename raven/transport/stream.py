"""One stream of a session, as the services use it: reads and writes that await the session's events.

A :class:`Stream` is made and woken by its session (raven/transport/tunnel.py), which calls the methods under
"the session's events"; the service awaits :meth:`Stream.head`, :meth:`Stream.read`, :meth:`Stream.write`.
Reading returns credit to the peer as the consumer takes data; writing waits for credit and for room in the
session's send queue. What a stream asks of its session is the small :class:`Link` surface below, so this module
does not import the session's.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from typing import Protocol

from raven.protocol import wire
from raven.protocol.stream import StreamReset

_EMPTY = b""


class Link(Protocol):
    """What a stream needs of its session: the loop, room to send, and the stream operations of the core, each
    followed by whatever the session must do next (wake its writer, let go of a finished stream)."""

    @property
    def loop(self) -> asyncio.AbstractEventLoop: ...

    def congested(self, stream_id: int) -> bool:
        """More is queued than the session lets this stream add to: :meth:`wait_send_room` first."""
        ...

    async def wait_send_room(self, stream_id: int) -> None: ...

    def consumed(self, stream_id: int, n: int) -> None: ...

    def send_data(self, stream_id: int, data: memoryview, fin: bool) -> int: ...

    def send_head(self, stream: Stream, status: int, reason: str, headers: wire.Headers, fin: bool) -> None: ...

    def end_stream(self, stream: Stream) -> None: ...

    def reset_stream(self, stream: Stream, code: wire.ResetCode, reason: str) -> None: ...

    def done_writing(self, stream: Stream) -> None: ...


class Stream:
    """One request or connection inside a session: reads and writes that await the session's events."""

    __slots__ = (
        "_chunks",
        "_credit_waiter",
        "_data_waiter",
        "_finished",
        "_head",
        "_link",
        "_remote_fin",
        "_reset",
        "bytes_in",
        "bytes_out",
        "id",
        "local_fin",
        "open",
    )

    def __init__(self, link: Link, stream_id: int, open_frame: wire.Open, *, opener: bool) -> None:
        self._link = link
        self.id = stream_id
        self.open = open_frame
        self._chunks: collections.deque[memoryview] = collections.deque()
        self._data_waiter: asyncio.Future[None] | None = None
        self._credit_waiter: asyncio.Future[None] | None = None
        self._head: asyncio.Future[wire.Head] = link.loop.create_future()
        self._finished: asyncio.Future[None] = link.loop.create_future()
        self._remote_fin = open_frame.fin and not opener
        self.local_fin = open_frame.fin and opener
        self._reset: StreamReset | None = None
        self.bytes_in = 0
        self.bytes_out = 0

    # ------------------------------------------------------------ state

    @property
    def finished(self) -> bool:
        return self._finished.done()

    @property
    def readable(self) -> bool:
        """:meth:`read` would return (or raise) without waiting: data, the end or a reset is already here."""
        return bool(self._chunks) or self._remote_fin or self._reset is not None

    @property
    def answered(self) -> bool:
        """The peer's whole answer is here (its FIN came): a reset after it only said "stop sending"."""
        return self._remote_fin

    @property
    def reset_error(self) -> StreamReset | None:
        return self._reset

    @staticmethod
    def _wake(fut: asyncio.Future[None] | None) -> None:
        if fut is not None and not fut.done():
            fut.set_result(None)

    # ------------------------------------------------------------ the session's events (called by the session)

    def head_received(self, head: wire.Head) -> None:
        self._head.set_result(head)

    def credit_received(self) -> None:
        self._wake(self._credit_waiter)

    def data_received(self, data: memoryview, fin: bool) -> None:
        if data:
            # A chunk is a view into its whole received message: while it waits here it keeps the message alive.
            # Where it is under half of a batched message (other frames beside it), it is copied out, so that
            # what a stream holds stays within twice its window however the peer packs its messages.
            owner = data.obj
            if isinstance(owner, bytes | bytearray) and len(data) * 2 < len(owner):
                data = memoryview(bytes(data))
            self._chunks.append(data)
            self.bytes_in += len(data)
        if fin:
            self._remote_fin = True
        self._wake(self._data_waiter)

    def released(self) -> None:
        """The session let go of the stream (both ways ended, or reset): :meth:`wait_finished` returns."""
        if not self._finished.done():
            self._finished.set_result(None)

    def aborted(self, err: StreamReset) -> None:
        if self._reset is not None:
            return
        self._reset = err
        if not self._remote_fin:
            # Data of an unfinished half is dropped. A reset after the peer's FIN only says "stop sending" (the
            # agent answered before it read the whole request body): what arrived stays readable to the end.
            self._chunks.clear()
        if not self._head.done():
            self._head.set_exception(err)
            self._head.exception()  # mark retrieved: nobody may be waiting for a head
        self._wake(self._data_waiter)
        self._wake(self._credit_waiter)

    # ------------------------------------------------------------ public API

    def on_finished(self, callback: Callable[[Stream], None]) -> None:
        """Call ``callback(stream)`` soon after the stream has finished (both ways ended, or reset by either side).

        A callback instead of a task that awaits :meth:`wait_finished`: no task per stream for a watcher.
        """
        self._finished.add_done_callback(lambda _: callback(self))

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
                self._link.consumed(self.id, len(chunk))
                return chunk
            if self._remote_fin:
                return _EMPTY
            if self._reset is not None:
                raise self._reset
            self._data_waiter = self._link.loop.create_future()
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
        view = data if isinstance(data, memoryview) else memoryview(data)
        if end and not view:
            self.end()
            return
        link = self._link
        send = link.send_data
        while view:
            if self._reset is not None:
                raise self._reset
            if link.congested(self.id):
                await link.wait_send_room(self.id)
                continue
            n = send(self.id, view, end)
            if n == 0:
                self._credit_waiter = link.loop.create_future()
                try:
                    await self._credit_waiter
                finally:
                    self._credit_waiter = None
                continue
            self.bytes_out += n
            view = view[n:]
        if end:
            self.local_fin = True
            link.done_writing(self)

    def end(self) -> None:
        """Half-close: no more data from this side. Idempotent."""
        if self.local_fin or self._reset is not None or self.finished:
            return
        self.local_fin = True
        self._link.end_stream(self)

    def send_head(self, status: int, reason: str, headers: wire.Headers, fin: bool = False) -> None:
        """Send the response head (acceptor side)."""
        if self._reset is not None:
            raise self._reset
        self._link.send_head(self, status, reason, headers, fin)
        if fin:
            self.local_fin = True
            self._link.done_writing(self)

    def reset(self, code: wire.ResetCode, reason: str) -> None:
        """Abort the stream in both directions and tell the peer. Idempotent."""
        if self.finished:
            return
        self._link.reset_stream(self, code, reason)

    def close(self) -> None:
        """Ensure the stream is finished: a stream not cleanly ended both ways is cancelled."""
        if not self.finished:
            self.reset(wire.ResetCode.CANCEL, "closed by the local side")
