"""One stream of a session, as the services use it: reads and writes that await the session's events.

A :class:`Stream` is made and woken by its :class:`raven.transport.session.Session` (the events of the sans-I/O
core); the service awaits :meth:`Stream.head`, :meth:`Stream.read`, :meth:`Stream.write`. Reading returns credit
to the peer as the consumer takes data; writing waits for credit and for room in the session's send queue.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from typing import TYPE_CHECKING

from raven.protocol import wire
from raven.protocol.session import StreamReset

if TYPE_CHECKING:
    from raven.transport.session import Session

_EMPTY = b""


class Stream:
    """One request or connection inside a session: reads and writes that await the session's events."""

    __slots__ = (
        "_chunks",
        "_credit_waiter",
        "_data_waiter",
        "_finished",
        "_head",
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
        self._chunks: collections.deque[memoryview] = collections.deque()
        self._data_waiter: asyncio.Future[None] | None = None
        self._credit_waiter: asyncio.Future[None] | None = None
        self._head: asyncio.Future[wire.Head] = session.loop.create_future()
        self._finished: asyncio.Future[None] = session.loop.create_future()
        self._remote_fin = open_frame.fin and not session.opener
        self.local_fin = open_frame.fin and session.opener
        self._reset: StreamReset | None = None
        self.bytes_in = 0
        self.bytes_out = 0

    # ------------------------------------------------------------ state

    @property
    def finished(self) -> bool:
        return self._finished.done()

    @property
    def reset_error(self) -> StreamReset | None:
        return self._reset

    @staticmethod
    def _wake(fut: asyncio.Future[None] | None) -> None:
        if fut is not None and not fut.done():
            fut.set_result(None)

    # ------------------------------------------------------------ the session's events

    def _on_head(self, head: wire.Head) -> None:
        self._head.set_result(head)

    def _on_data(self, data: memoryview, fin: bool) -> None:
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
                session = self._session
                session.core.consumed(self.id, len(chunk))
                session._kick()
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
        view = data if isinstance(data, memoryview) else memoryview(data)
        if end and not view:
            self.end()
            return
        session = self._session
        send = session.core.send_data
        while view:
            if self._reset is not None:
                raise self._reset
            if session._queued > session.HIGH_WATER:
                await session._wait_send_room()
                continue
            n = send(self.id, view, end)
            if n == 0:
                self._credit_waiter = session.loop.create_future()
                try:
                    await self._credit_waiter
                finally:
                    self._credit_waiter = None
                continue
            self.bytes_out += n
            view = view[n:]
            session._kick()
        if end:
            self.local_fin = True
            session._release_if_done(self)

    def end(self) -> None:
        """Half-close: no more data from this side. Idempotent."""
        if self.local_fin or self._reset is not None or self.finished:
            return
        self.local_fin = True
        session = self._session
        session.core.end_stream(self.id)
        session._kick()
        session._release_if_done(self)

    def send_head(self, status: int, reason: str, headers: wire.Headers, fin: bool = False) -> None:
        """Send the response head (acceptor side)."""
        if self._reset is not None:
            raise self._reset
        session = self._session
        session.core.send_head(self.id, status, reason, headers, fin)
        if fin:
            self.local_fin = True
        session._kick()
        if fin:
            session._release_if_done(self)

    def reset(self, code: wire.ResetCode, reason: str) -> None:
        """Abort the stream in both directions and tell the peer. Idempotent."""
        if self.finished:
            return
        session = self._session
        session.core.reset_stream(self.id, code, reason)
        session._kick()
        self._on_reset(StreamReset(code, reason, remote=False))
        session._release(self)

    def close(self) -> None:
        """Ensure the stream is finished: a stream not cleanly ended both ways is cancelled."""
        if not self.finished:
            self.reset(wire.ResetCode.CANCEL, "closed by the local side")
