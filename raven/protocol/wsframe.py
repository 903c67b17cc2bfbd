"""RFC 6455 framing, sans-I/O: bytes in, events out, frames out as bytes. What the tunnel carries after the HTTP
Upgrade (which aiohttp still does: raven/transport/wslink.py takes the connection's bytes over after it).

:class:`FrameDecoder` turns received bytes into binary messages (``bytes``, or a ``bytearray`` it unmasked) and
the control events :class:`Ping`, :class:`Pong` and :class:`Close`; it joins fragmented messages. Anything the
RFC refuses, or a tunnel does not carry, raises :class:`WebSocketError` with the close code to answer and a
reason: a frame masked the wrong way for its direction (a client masks, a server does not), reserved bits (no
extension is negotiated), an unknown opcode, a fragmented or over-long control frame, a continuation with no
message begun or a new message in the middle of one, a text message, a close frame whose code or reason is
invalid, and a message over ``max_message`` bytes: refused from its frame's header, before any of its payload is
held. Nothing else ever escapes for hostile input.

:class:`FrameEncoder` writes frames: binary messages (one frame each), pings, pongs and close frames; a client's
are masked with a fresh key per frame. Masking is a byte-wise XOR: the pure-Python one here
(:func:`mask_python`, one big integer) is correct but slow (~130 µs for 50 KiB); the transport passes a compiled
one (aiohttp's) through ``masker``.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from mypy_extensions import mypyc_attr

from raven.errors import RavenError

OP_CONTINUATION: Final = 0x0
OP_TEXT: Final = 0x1
OP_BINARY: Final = 0x2
OP_CLOSE: Final = 0x8
OP_PING: Final = 0x9
OP_PONG: Final = 0xA

# Close codes (RFC 6455 section 7.4.1).
CLOSE_NORMAL: Final = 1000
CLOSE_GOING_AWAY: Final = 1001
CLOSE_PROTOCOL_ERROR: Final = 1002
CLOSE_UNSUPPORTED_DATA: Final = 1003
CLOSE_INVALID_DATA: Final = 1007
CLOSE_POLICY: Final = 1008
CLOSE_TOO_BIG: Final = 1009
CLOSE_INTERNAL_ERROR: Final = 1011
# Codes a peer may send in a close frame; 1005, 1006 and 1015 are never sent, others are reserved.
_SENDABLE: Final = frozenset({1000, 1001, 1002, 1003, 1007, 1008, 1009, 1010, 1011, 1012, 1013, 1014})

MAX_CONTROL_PAYLOAD: Final = 125
MAX_REASON: Final = 123  # bytes of a close frame's reason (125 less the code)

_U16: Final = struct.Struct("!H")
_U64: Final = struct.Struct("!Q")
_HEAD2: Final = struct.Struct("!BB")
_HEAD4: Final = struct.Struct("!BBH")
_HEAD10: Final = struct.Struct("!BBQ")

Masker = Callable[[bytes, bytearray], None]  # XOR a bytearray in place with a 4-byte key, repeated


@mypyc_attr(native_class=False)  # an exception with a constructor of its own: an ordinary class when compiled
class WebSocketError(RavenError):
    """The peer broke RFC 6455 (or sent what a tunnel does not carry): ``code`` is the close code to answer with,
    ``reason`` says why (for the log, and the close frame's reason cut to 123 bytes)."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Ping:
    payload: bytes


@dataclass(frozen=True, slots=True)
class Pong:
    payload: bytes


@dataclass(frozen=True, slots=True)
class Close:
    """The peer's close frame: ``code`` is None when it carried none (1005, "no status")."""

    code: int | None
    reason: str


WsEvent = bytes | bytearray | Ping | Pong | Close


def mask_python(key: bytes, data: bytearray) -> None:
    """XOR ``data`` in place with ``key`` repeated (RFC 6455 section 5.3), as one big integer."""
    n = len(data)
    if n:
        keys = (key * ((n >> 2) + 1))[:n]
        data[:] = (int.from_bytes(data, "little") ^ int.from_bytes(keys, "little")).to_bytes(n, "little")


def close_payload(code: int, reason: str) -> bytes:
    """A close frame's payload: the code, then the reason in UTF-8 cut to what fits (never mid-character)."""
    raw = reason.encode("utf-8", "replace")[:MAX_REASON].decode("utf-8", "ignore").encode()
    return _U16.pack(code) + raw


def parse_close(payload: bytes) -> Close:
    """A received close frame's payload, checked as RFC 6455 section 5.5.1 says."""
    if not payload:
        return Close(None, "")
    if len(payload) == 1:
        raise WebSocketError(CLOSE_PROTOCOL_ERROR, "close frame with a 1-byte payload")
    code = _U16.unpack_from(payload)[0]
    if code not in _SENDABLE and not 3000 <= code <= 4999:
        raise WebSocketError(CLOSE_PROTOCOL_ERROR, f"close frame with invalid code {code}")
    try:
        reason = payload[2:].decode("utf-8")
    except UnicodeDecodeError:
        raise WebSocketError(CLOSE_INVALID_DATA, "close frame whose reason is not UTF-8") from None
    return Close(code, reason)


class FrameDecoder:
    """Received bytes to events, for one direction of one connection.

    ``client``: this side is the client (frames from the server must not be masked; else they must be).
    ``max_message``: the largest message (all its fragments together), inclusive. After a close frame, or after
    an error, everything more is ignored.
    """

    __slots__ = ("_client", "_done", "_held", "_masker", "_max", "_need", "_parts", "_pending", "_size")

    def __init__(self, *, client: bool, max_message: int, masker: Masker = mask_python) -> None:
        self._client = client
        self._max = max_message
        self._masker = masker
        # An incomplete frame: the received pieces as they came (joined once, when enough is there: no buffer
        # grown and shrunk read after read), their bytes, and how many the frame needs before it is looked at again.
        # Both lists exist only while they hold something (an idle connection keeps neither).
        self._held: list[bytes | memoryview] | None = None
        self._pending = 0
        self._need = 0
        self._parts: list[bytes | bytearray] | None = None  # a fragmented message so far
        self._size = 0  # its bytes
        self._done = False

    @property
    def buffered(self) -> int:
        """Bytes held: an incomplete frame and a fragmented message's parts."""
        return self._pending + self._size

    def receive(self, data: bytes | bytearray) -> list[WsEvent]:
        """The events in ``data`` and what came before it. Raises :class:`WebSocketError` only."""
        if self._done:
            return []
        held = self._held
        if held is not None:
            held.append(bytes(data) if isinstance(data, bytearray) else data)
            self._pending += len(data)
            if self._pending < self._need:
                return []
            source: bytes | bytearray = b"".join(held)
            self._held = None
            self._pending = 0
        else:
            source = data
        events: list[WsEvent] = []
        try:
            used = self._frames(source, events)
        except WebSocketError:
            self._done = True
            self._held = None
            self._pending = 0
            self._parts = None
            self._size = 0
            raise
        if not self._done and used < len(source):
            rest = memoryview(source)[used:] if isinstance(source, bytes) else bytes(memoryview(source)[used:])
            self._held = [rest]
            self._pending = len(rest)
        return events

    def _frames(self, buf: bytes | bytearray, events: list[WsEvent]) -> int:
        """Parse every complete frame of ``buf`` into ``events``; how many bytes they took."""
        pos = 0
        end = len(buf)
        view = memoryview(buf)
        try:
            self._need = 2
            while end - pos >= 2 and not self._done:
                b0 = buf[pos]
                b1 = buf[pos + 1]
                opcode = b0 & 0x0F
                length = b1 & 0x7F
                self._check(b0, b1, opcode, length)  # from the first two bytes, before any length is read
                head = pos + 2
                if length == 126:
                    if end - head < 2:
                        self._need = 4
                        break
                    length = _U16.unpack_from(buf, head)[0]
                    head += 2
                elif length == 127:
                    if end - head < 8:
                        self._need = 10
                        break
                    length = _U64.unpack_from(buf, head)[0]
                    head += 8
                # A control frame between a message's fragments is no part of it (and is 125 bytes at most).
                size = length if opcode >= OP_CLOSE else length + self._size
                if size > self._max:
                    raise WebSocketError(CLOSE_TOO_BIG, f"message of over {size} bytes "
                                                        f"(limit {self._max}, limits.max_frame)")
                masked = b1 & 0x80
                if masked:
                    head += 4
                stop = head + length
                if end < stop:
                    self._need = stop - pos
                    break
                payload: bytes | bytearray
                if masked:
                    unmasked = bytearray(view[head:stop])
                    self._masker(bytes(view[head - 4:head]), unmasked)
                    payload = unmasked
                else:
                    payload = bytes(view[head:stop])
                pos = stop
                self._need = 2
                if opcode >= OP_CLOSE:
                    self._control(opcode, bytes(payload), events)
                elif b0 & 0x80:  # FIN
                    parts = self._parts
                    if parts is not None:
                        parts.append(payload)
                        payload = b"".join(parts)
                        self._parts = None
                        self._size = 0
                    events.append(payload)
                else:
                    if self._parts is None:
                        self._parts = []
                    self._parts.append(payload)
                    self._size += length
        finally:
            view.release()
        return pos

    def _check(self, b0: int, b1: int, opcode: int, length: int) -> None:
        """A frame's first two bytes (``length``: the 7-bit one), before any more of it is read."""
        if b0 & 0x70:
            raise WebSocketError(CLOSE_PROTOCOL_ERROR, f"reserved bits set ({b0 & 0x70:#x}): no extension was agreed")
        if bool(b1 & 0x80) == self._client:
            raise WebSocketError(CLOSE_PROTOCOL_ERROR, "masked frame from the server" if self._client
                                 else "unmasked frame from the client")
        if opcode >= OP_CLOSE:
            if opcode > OP_PONG:
                raise WebSocketError(CLOSE_PROTOCOL_ERROR, f"unknown opcode {opcode:#x}")
            if not b0 & 0x80:
                raise WebSocketError(CLOSE_PROTOCOL_ERROR, f"fragmented control frame (opcode {opcode:#x})")
            if length > MAX_CONTROL_PAYLOAD:
                raise WebSocketError(CLOSE_PROTOCOL_ERROR, f"control frame of {length} bytes (limit 125)")
            return
        if opcode == OP_TEXT:
            raise WebSocketError(CLOSE_UNSUPPORTED_DATA, "text message: the tunnel carries binary messages only")
        if opcode == OP_CONTINUATION:
            if not self._parts:
                raise WebSocketError(CLOSE_PROTOCOL_ERROR, "continuation frame with no message begun")
        elif opcode != OP_BINARY:
            raise WebSocketError(CLOSE_PROTOCOL_ERROR, f"unknown opcode {opcode:#x}")
        elif self._parts:
            raise WebSocketError(CLOSE_PROTOCOL_ERROR, "new message in the middle of a fragmented one")

    def _control(self, opcode: int, payload: bytes, events: list[WsEvent]) -> None:
        if opcode == OP_PING:
            events.append(Ping(payload))
        elif opcode == OP_PONG:
            events.append(Pong(payload))
        else:
            events.append(parse_close(payload))
            self._done = True  # nothing is read after a close frame


class FrameEncoder:
    """Frames to send, for one direction of one connection: masked with a fresh key each when ``client``."""

    __slots__ = ("_client", "_keys", "_masker")

    def __init__(self, *, client: bool, masker: Masker = mask_python,
                 keys: Callable[[int], bytes] = os.urandom) -> None:
        self._client = client
        self._masker = masker
        self._keys = keys  # called with 4: the masking key's bytes (unpredictable, RFC 6455 section 10.3)

    def frame(self, opcode: int, payload: bytes | bytearray | memoryview, fin: bool = True) -> bytes | bytearray:
        """One frame, header and payload, in one buffer: the payload is copied once (and masked in place)."""
        n = len(payload)
        b0 = opcode | 0x80 if fin else opcode
        mask_bit = 0x80 if self._client else 0
        if n < 126:
            head = _HEAD2.pack(b0, n | mask_bit)
        elif n < 65536:
            head = _HEAD4.pack(b0, 126 | mask_bit, n)
        else:
            head = _HEAD10.pack(b0, 127 | mask_bit, n)
        if not self._client:
            return head + payload
        key = self._keys(4)
        prefix = head + key
        out = bytearray(prefix)
        out += payload
        # Mask the whole buffer with the key turned so that it lines up with the payload, then put the header and
        # the key back: one pass over the payload, no second copy.
        shift = len(prefix) & 3
        self._masker(key[-shift:] + key[:-shift] if shift else key, out)
        out[:len(prefix)] = prefix
        return out

    def binary(self, messages: list[bytes]) -> bytes:
        """Each message as one binary frame, all in one ``bytes`` (the transport writes each frame as it is made
        instead: raven/transport/wslink.py)."""
        return b"".join([self.frame(OP_BINARY, m) for m in messages])

    def ping(self, payload: bytes = b"") -> bytes | bytearray:
        return self.frame(OP_PING, payload[:MAX_CONTROL_PAYLOAD])

    def pong(self, payload: bytes) -> bytes | bytearray:
        return self.frame(OP_PONG, payload[:MAX_CONTROL_PAYLOAD])

    def close(self, code: int = CLOSE_NORMAL, reason: str = "") -> bytes | bytearray:
        return self.frame(OP_CLOSE, close_payload(code, reason))
