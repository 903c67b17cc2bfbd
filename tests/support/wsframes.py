"""WebSocket frames built by hand (RFC 6455), so that a test can break the rules a codec must enforce."""

from __future__ import annotations

import os
import struct

from raven.protocol.wsframe import mask_python


def raw_frame(opcode: int, payload: bytes, *, fin: bool = True, mask: bool = False, rsv: int = 0,
              length: int | None = None) -> bytes:
    """A frame with ``opcode``; ``length`` claims another payload length than ``payload``'s; masked with a random
    key when ``mask``."""
    n = len(payload) if length is None else length
    b0 = (0x80 if fin else 0) | rsv | opcode
    m = 0x80 if mask else 0
    if n < 126:
        head = struct.pack("!BB", b0, n | m)
    elif n < 65536:
        head = struct.pack("!BBH", b0, 126 | m, n)
    else:
        head = struct.pack("!BBQ", b0, 127 | m, n)
    if not mask:
        return head + payload
    key = os.urandom(4)
    body = bytearray(payload)
    mask_python(key, body)
    return head + key + bytes(body)
