"""What a session has to send, and how it leaves: frames in order, then layer-3 packets, as WebSocket messages.

Version 1: one frame per message. Version 2: everything queued since the last :meth:`Outbox.take` in as few
messages of at most ``BATCH_BUDGET`` bytes as it fits (length-prefixed frames). Payloads are referenced, not
copied, until then (a mutable buffer is copied when queued); the one copy is the message's join. Packets (DATAGRAM
frames) wait apart, bounded by ``DATAGRAM_QUEUE`` (more are refused: IP semantics), and go after the frames of the
same turn, so that layer 7 keeps its latency while layer 3 is saturated.
"""

from __future__ import annotations

from typing import Final

from raven.protocol import wire

_Out = tuple[bytes, "bytes | memoryview | None"]


def _readonly(data: bytes | bytearray | memoryview) -> memoryview:
    view = data if isinstance(data, memoryview) else memoryview(data)
    return view if view.readonly else memoryview(bytes(view))


class Outbox:
    __slots__ = ("_datagram_bytes", "_datagrams", "_frames", "batched", "pending_bytes")

    BATCH_BUDGET: Final = 128 * 1024  # bytes of frames per batched message (every peer accepts 256 KiB)
    DATAGRAM_QUEUE: Final = 256 * 1024  # bytes of layer-3 packets waiting to go; more are refused, never queued

    def __init__(self, batched: bool) -> None:
        self.batched = batched
        self._frames: list[_Out] = []  # everything queued leaves at once (take): a list, not a deque
        self._datagrams: list[_Out] = []
        self._datagram_bytes = 0
        self.pending_bytes = 0  # bytes queued and not yet taken

    def frame(self, frame: wire.Frame) -> None:
        encoded = wire.encode(frame)
        if self.batched:
            self._frames.append((wire.length_prefix(len(encoded)), encoded))
            self.pending_bytes += 4 + len(encoded)
        else:
            self._frames.append((encoded, None))
            self.pending_bytes += len(encoded)

    def data(self, stream_id: int, chunk: memoryview, fin: bool) -> None:
        """A DATA frame: its header now, its payload by reference (copied here only if the buffer is mutable)."""
        self._frames.append((wire.data_header(stream_id, len(chunk), fin, self.batched), _readonly(chunk)))
        self.pending_bytes += (10 if self.batched else 6) + len(chunk)

    def datagram(self, packet: bytes | bytearray | memoryview) -> bool:
        """Queue one IP packet (version 2 only); False if it does not fit the queue."""
        size = wire.HEADER_SIZE + len(packet) + 4
        if not self.batched or self._datagram_bytes + size > self.DATAGRAM_QUEUE:
            return False
        view = _readonly(packet)
        self._datagrams.append((wire.datagram_header(len(view)), view))
        self._datagram_bytes += size
        self.pending_bytes += size
        return True

    def drop_datagrams(self) -> None:
        self.pending_bytes -= self._datagram_bytes
        self._datagrams = []
        self._datagram_bytes = 0

    def take(self) -> list[bytes]:
        """Everything queued, as WebSocket messages: one per frame in version 1, batched from version 2."""
        out = self._frames
        if self._datagrams:
            out += self._datagrams
            self._datagrams = []
            self._datagram_bytes = 0
        if not out:
            return []
        self._frames = []
        self.pending_bytes = 0
        if not self.batched:
            return [head if body is None else head + body for head, body in out]
        budget = self.BATCH_BUDGET
        messages: list[bytes] = []
        parts: list[bytes | memoryview] = []
        size = 0
        for head, body in out:
            n = len(head) + (0 if body is None else len(body))
            if parts and size + n > budget:
                messages.append(b"".join(parts))
                parts, size = [], 0
            parts.append(head)
            if body is not None:
                parts.append(body)
            size += n
        messages.append(parts[0] if len(parts) == 1 and isinstance(parts[0], bytes) else b"".join(parts))
        return messages
