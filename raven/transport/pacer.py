"""Keep a tunnel's backlog in the session, where its scheduler can order it, not in the kernel's send buffer.

Without this, the kernel takes whatever the session writes, up to a send buffer that autotunes to megabytes: a
download's window queued there is sent before a scrape written after it, seconds later on a slow uplink (issue 29,
item 9). A :class:`Pacer` sets ``TCP_NOTSENT_LOWAT`` on the tunnel's socket and tells the session's writer how
many bytes the kernel may still take (:meth:`Pacer.room`); the writer takes that much from the session's outbox
(raven/protocol/outbox.py decides which) and otherwise waits until the kernel has sent enough
(:meth:`Pacer.writable`: the socket's writability, which the low mark governs). What waits below the session is
then ``QUEUE_TIME`` of data at the connection's rate, whatever the link.

The mark follows the connection: its delivery rate (``tcpi_delivery_rate``; else a congestion window per round
trip) times ``QUEUE_TIME``, kept within [``MIN_LOWAT``, ``MAX_LOWAT``]. Not one congestion window: with BBR (or a
deep bottleneck queue) that is two round trips of data, 300 ms ahead of a scrape on a 150 ms link.

The wait watches a duplicate of the socket's descriptor (the transport owns the original, and asyncio and uvloop
refuse a second watcher on it), made for the wait and closed when it ends, so that a session holds no second
descriptor between waits; :meth:`Pacer.close`, which the session calls before it closes its transport, ends a
wait in progress (a duplicate left open would keep the connection open after the transport's close).

Asking the kernel costs a system call and, on uvloop, a socket object made and detached for it. What the kernel
said last, less what was written since (:meth:`Pacer.spent`), is a floor of the room now (the kernel only sends
what it holds; the mark changes only when asked): when that floor covers what the writer wants, it is the answer
without asking. A scrape's few kilobytes then ask once per mark's worth, not at every turn of the writer.
"""

from __future__ import annotations

import asyncio
import os
import socket
import struct
from typing import Any, Final

TCP_NOTSENT_LOWAT: Final = getattr(socket, "TCP_NOTSENT_LOWAT", 25)
# struct tcp_info (linux/tcp.h): tcpi_snd_mss at 16, tcpi_rtt (us) at 68, tcpi_snd_cwnd at 80, tcpi_notsent_bytes
# at 144 (Linux 4.6+), tcpi_delivery_rate (bytes/s) at 160 (4.9+).
_INFO_SIZE: Final = 168
_U32: Final = struct.Struct("=I")
_U64: Final = struct.Struct("=Q")


class Pacer:
    """The kernel's share of one tunnel socket's backlog (its unsent bytes), and a wait for room in it."""

    __slots__ = ("_closed", "_credit", "_loop", "_sock", "_waiting", "lowat")

    QUEUE_TIME: Final = 0.02  # seconds of data the kernel may hold unsent: ahead of a scrape, and what covers the
    # writer's wake-up on a fast link
    MIN_LOWAT: Final = 16 * 1024  # below this, the writer would wake for every few segments
    MAX_LOWAT: Final = 1 << 20  # bytes: at a rate where 20 ms is more than this, 1 MiB is brief

    def __init__(self, sock: Any, loop: asyncio.AbstractEventLoop) -> None:
        self._sock = sock
        self._loop = loop
        self._waiting: tuple[int, asyncio.Future[None]] | None = None  # the duplicate descriptor, the waiter
        self._closed = False
        self._credit = 0  # the room the kernel said last, less what was written since: a floor of the room now
        self.lowat = self.MIN_LOWAT
        sock.setsockopt(socket.IPPROTO_TCP, TCP_NOTSENT_LOWAT, self.lowat)

    @classmethod
    def of(cls, sock: Any, loop: asyncio.AbstractEventLoop) -> Pacer | None:
        """A pacer for a TCP socket (a transport's ``get_extra_info("socket")``), None for anything else."""
        if sock is None or getattr(sock, "family", None) not in (socket.AF_INET, socket.AF_INET6):
            return None
        try:
            return cls(sock, loop)
        except OSError:
            return None  # not TCP, or the option is missing: unpaced, as before

    def room(self, want: int = 0) -> int:
        """Bytes the kernel may take now without holding more than its low mark unsent (maybe <= 0); when the
        floor kept since the last answer is at least ``want`` (> 0), that floor, without asking the kernel."""
        if self._closed:
            return 1 << 30
        if 0 < want <= self._credit:
            return self._credit
        try:
            info = self._sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _INFO_SIZE)
        except OSError:
            return 1 << 30  # the socket is gone: the writer's send fails and ends the session
        if len(info) < 148:
            return 1 << 30  # a kernel without tcpi_notsent_bytes: unpaced
        rate = _U64.unpack_from(info, 160)[0] if len(info) >= _INFO_SIZE else 0
        if not rate:
            rtt = _U32.unpack_from(info, 68)[0]
            rate = _U32.unpack_from(info, 80)[0] * _U32.unpack_from(info, 16)[0] * 1_000_000 // rtt if rtt else 0
        lowat = min(self.MAX_LOWAT, max(self.MIN_LOWAT, int(rate * self.QUEUE_TIME)))
        if abs(lowat - self.lowat) * 4 > self.lowat:  # a quarter off: follow the window
            try:
                self._sock.setsockopt(socket.IPPROTO_TCP, TCP_NOTSENT_LOWAT, lowat)
                self.lowat = lowat
            except OSError:
                pass
        self._credit = room = self.lowat - int(_U32.unpack_from(info, 144)[0])
        return room

    def spent(self, size: int) -> None:
        """``size`` bytes were written to the socket since the last :meth:`room`: the floor is that much lower.
        The caller counts what the socket gets (its framing too), else the floor would run above the room."""
        self._credit -= size

    async def writable(self) -> None:
        """Until the kernel has sent enough of what it holds (the socket is writable again), or :meth:`close`."""
        if self._closed or self._waiting is not None:
            return
        try:
            fd = os.dup(self._sock.fileno())
        except OSError:
            return  # the transport has closed its socket: the writer's send fails and ends the session
        waiting = self._waiting = (fd, self._loop.create_future())
        try:
            self._loop.add_writer(fd, _wake, waiting[1])
            await waiting[1]
        finally:
            if self._waiting is waiting:  # else close() has ended the watch and closed the descriptor
                self._stop()

    def _stop(self) -> None:
        waiting, self._waiting = self._waiting, None
        if waiting is not None:
            fd, waiter = waiting
            self._loop.remove_writer(fd)
            os.close(fd)
            _wake(waiter)

    def close(self) -> None:
        """End a wait in progress and close its duplicate descriptor (the transport's socket then closes for
        real); no wait starts after this. Idempotent."""
        self._closed = True
        self._stop()


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)
